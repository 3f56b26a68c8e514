// kubelet-stub plays the kubelet's side of the device-plugin API for memstrata's tests.
//
// It is built from the upstream generated stubs (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1),
// written independently of the Python plugin it exercises, and talks to it over real unix
// sockets exactly as the kubelet's device manager does:
//
//   - on start it empties the device-plugins directory of sockets (the kubelet does the same,
//     which is why a plugin must notice a new kubelet.sock and serve and register again);
//   - it serves Registration on <dir>/kubelet.sock; for every Register it dials
//     <dir>/<endpoint>, calls GetDevicePluginOptions and keeps a ListAndWatch stream open;
//   - it reads commands from stdin, one JSON object per line:
//     {"op":"allocate","resource":"memstrata.dev/nvme-ns","ids":["..."]}
//     {"op":"preferred","resource":"...","available":["..."],"size":2}
//     {"op":"quit"}
//   - it reports everything it sees on stdout, one JSON object per line ("event": "ready",
//     "register", "options", "devices", "stream-end", "allocate", "preferred", "error").
//
// A restart of the kubelet is a restart of this process: the test stops it and starts a new
// one on the same directory.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// emitter writes one JSON event per line; concurrent writers must not interleave.
type emitter struct {
	mu  sync.Mutex
	enc *json.Encoder
}

func (e *emitter) emit(event string, fields map[string]any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if fields == nil {
		fields = map[string]any{}
	}
	fields["event"] = event
	fields["time"] = time.Now().UnixNano()
	_ = e.enc.Encode(fields)
}

// plugin is one registered resource: its connection and client.
type plugin struct {
	resource string
	endpoint string
	conn     *grpc.ClientConn
	client   pluginapi.DevicePluginClient
	cancel   context.CancelFunc
}

type stub struct {
	pluginapi.UnimplementedRegistrationServer
	dir     string
	out     *emitter
	mu      sync.Mutex
	plugins map[string]*plugin
}

func (s *stub) Register(ctx context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	s.out.emit("register", map[string]any{
		"version": req.Version, "endpoint": req.Endpoint, "resource": req.ResourceName,
		"options": optionsJSON(req.Options),
	})
	// The same checks the kubelet's device manager makes before accepting a plugin.
	if req.Version != pluginapi.Version {
		return nil, fmt.Errorf("unsupported API version %q, want %q", req.Version, pluginapi.Version)
	}
	if !strings.Contains(req.ResourceName, "/") || req.Endpoint == "" || strings.Contains(req.Endpoint, "/") {
		return nil, fmt.Errorf("invalid registration: resource %q endpoint %q", req.ResourceName, req.Endpoint)
	}
	// The kubelet connects to the plugin after Register returns, never inside it.
	go s.connect(req.ResourceName, req.Endpoint)
	return &pluginapi.Empty{}, nil
}

func (s *stub) connect(resource, endpoint string) {
	sock := filepath.Join(s.dir, endpoint)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		s.out.emit("error", map[string]any{"resource": resource, "error": err.Error()})
		return
	}
	client := pluginapi.NewDevicePluginClient(conn)
	ctx, cancel := context.WithCancel(context.Background())
	p := &plugin{resource: resource, endpoint: endpoint, conn: conn, client: client, cancel: cancel}
	s.mu.Lock()
	if old, ok := s.plugins[resource]; ok { // re-registration replaces the old endpoint
		old.cancel()
		old.conn.Close()
	}
	s.plugins[resource] = p
	s.mu.Unlock()

	octx, ocancel := context.WithTimeout(ctx, 10*time.Second)
	opts, err := client.GetDevicePluginOptions(octx, &pluginapi.Empty{})
	ocancel()
	if err != nil {
		s.out.emit("error", map[string]any{"resource": resource, "call": "GetDevicePluginOptions", "error": err.Error()})
		return
	}
	s.out.emit("options", map[string]any{"resource": resource, "options": optionsJSON(opts)})

	stream, err := client.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		s.out.emit("error", map[string]any{"resource": resource, "call": "ListAndWatch", "error": err.Error()})
		return
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			s.out.emit("stream-end", map[string]any{"resource": resource, "endpoint": endpoint, "error": err.Error()})
			return
		}
		devices := []map[string]any{}
		for _, d := range resp.Devices {
			numa := []int64{}
			if d.Topology != nil {
				for _, n := range d.Topology.Nodes {
					numa = append(numa, n.ID)
				}
			}
			devices = append(devices, map[string]any{"id": d.ID, "health": d.Health, "numa": numa})
		}
		s.out.emit("devices", map[string]any{"resource": resource, "devices": devices})
	}
}

func optionsJSON(o *pluginapi.DevicePluginOptions) map[string]any {
	if o == nil {
		return nil
	}
	return map[string]any{"pre_start_required": o.PreStartRequired,
		"get_preferred_allocation_available": o.GetPreferredAllocationAvailable}
}

type command struct {
	Op        string   `json:"op"`
	Resource  string   `json:"resource"`
	IDs       []string `json:"ids"`
	Available []string `json:"available"`
	Size      int32    `json:"size"`
}

func (s *stub) client(resource string) pluginapi.DevicePluginClient {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.plugins[resource]; ok {
		return p.client
	}
	return nil
}

func (s *stub) handle(cmd command) {
	client := s.client(cmd.Resource)
	if client == nil {
		s.out.emit("error", map[string]any{"op": cmd.Op, "resource": cmd.Resource, "error": "resource not registered"})
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	switch cmd.Op {
	case "allocate":
		resp, err := client.Allocate(ctx, &pluginapi.AllocateRequest{
			ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: cmd.IDs}}})
		if err != nil {
			s.out.emit("allocate", map[string]any{"resource": cmd.Resource, "ids": cmd.IDs, "error": err.Error()})
			return
		}
		containers := []map[string]any{}
		for _, c := range resp.ContainerResponses {
			devs := []map[string]string{}
			for _, d := range c.Devices {
				devs = append(devs, map[string]string{"container_path": d.ContainerPath, "host_path": d.HostPath,
					"permissions": d.Permissions})
			}
			containers = append(containers, map[string]any{"envs": c.Envs, "devices": devs,
				"annotations": c.Annotations, "mounts": len(c.Mounts)})
		}
		s.out.emit("allocate", map[string]any{"resource": cmd.Resource, "ids": cmd.IDs, "containers": containers})
	case "preferred":
		resp, err := client.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
			ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
				AvailableDeviceIDs: cmd.Available, MustIncludeDeviceIDs: cmd.IDs, AllocationSize: cmd.Size}}})
		if err != nil {
			s.out.emit("preferred", map[string]any{"resource": cmd.Resource, "error": err.Error()})
			return
		}
		ids := []string{}
		for _, c := range resp.ContainerResponses {
			ids = append(ids, c.DeviceIDs...)
		}
		s.out.emit("preferred", map[string]any{"resource": cmd.Resource, "ids": ids})
	default:
		s.out.emit("error", map[string]any{"op": cmd.Op, "error": "unknown op"})
	}
}

// wipeSockets does what the kubelet's device manager does at start: stale sockets go.
func wipeSockets(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Type()&os.ModeSocket != 0 {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "device-plugins directory")
	wipe := flag.Bool("wipe", true, "remove existing sockets at start, as the kubelet does")
	flag.Parse()
	out := &emitter{enc: json.NewEncoder(os.Stdout)}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if *wipe {
		if err := wipeSockets(*dir); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	sock := filepath.Join(*dir, "kubelet.sock")
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	s := &stub{dir: *dir, out: out, plugins: map[string]*plugin{}}
	server := grpc.NewServer()
	pluginapi.RegisterRegistrationServer(server, s)
	go func() { _ = server.Serve(lis) }()
	out.emit("ready", map[string]any{"socket": sock})

	scanner := bufio.NewScanner(os.Stdin)
	for scanner.Scan() {
		var cmd command
		if err := json.Unmarshal(scanner.Bytes(), &cmd); err != nil {
			out.emit("error", map[string]any{"error": "bad command: " + err.Error()})
			continue
		}
		if cmd.Op == "quit" {
			break
		}
		go s.handle(cmd)
	}
	server.Stop()
	_ = os.Remove(sock)
}
