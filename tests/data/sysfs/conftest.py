"""Nothing under tests/data/sysfs is a test.

The captured trees keep sysfs's own symlinks, several of which point back at an
ancestor (`nvme0/nvme0c0n1/device -> ../..`) exactly as in /sys; pytest's directory
walk follows directory symlinks and would never finish.
"""

collect_ignore_glob = ["*"]
