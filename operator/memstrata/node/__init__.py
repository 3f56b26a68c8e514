"""memstrata.node: what a node is, read from sysfs, and the rules that keep its disks safe.

Discovery (`discovery`, `nvmescan`, `sysfs`) turns a sysfs tree into a NodeInventory;
`safety` is the one home of the rule for which block devices may be written; `header`
is the raw-NVMe engine's on-disk header format; `scrub` the one home of the rule that a
namespace is zeroed before another job may read it; `local` describes this machine for
local runs. Pure Python, no torch: the node agent and the runtime both use it.
"""
