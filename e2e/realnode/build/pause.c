/* pause: the pod sandbox's process. It holds the pod's namespaces open, reaps any child that
 * gets re-parented to it (it is PID 1 of the pod when the PID namespace is shared) and exits 0
 * on SIGTERM or SIGINT, so a pod stops at once instead of waiting out the kill timeout.
 * Built with `gcc -static`: the pause image holds this one file and nothing else. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_stop(int sig) { (void)sig; stop = 1; }

static void on_child(int sig) {
    (void)sig;
    int saved = errno; /* a handler must not clobber the interrupted code's errno */
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static int handle(int sig, void (*fn)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = fn;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = sig == SIGCHLD ? SA_NOCLDSTOP | SA_RESTART : 0;
    return sigaction(sig, &sa, NULL);
}

int main(int argc, char **argv) {
    if (argc > 1 && (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0)) {
        puts("memstrata pause 1");
        return 0;
    }
    if (handle(SIGTERM, on_stop) || handle(SIGINT, on_stop) || handle(SIGCHLD, on_child)) {
        perror("pause: sigaction");
        return 1;
    }
    /* Blocked except inside sigsuspend: a SIGTERM between the test of `stop` and the wait
     * would otherwise be missed and the pod would hang until SIGKILL. */
    sigset_t block, during;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGCHLD);
    sigprocmask(SIG_BLOCK, &block, &during);
    sigdelset(&during, SIGTERM);
    sigdelset(&during, SIGINT);
    sigdelset(&during, SIGCHLD);
    while (!stop)
        sigsuspend(&during);
    return 0;
}
