"""What a FineTuneJob may ask its pods for: the operator must never give a job more than its submitter could have.

The operator creates pods with its own rights, for users who may have none: a user allowed to create
FineTuneJobs but not Pods would otherwise get, through the operator, a pod that mounts the node's `/`
(hostPath), a Secret they may not read, or runs any image and command they like. So a job's volumes, image and
command are held to what the cluster admin opened in the chart (values `jobPolicy`, passed to the operator as
flags); a job that asks for more fails at once with a message naming the field, and no pod is made for it.

The chart's ValidatingAdmissionPolicy (charts/memstrata/templates/job-policy.yaml) says the same at
`kubectl apply`, from the same values; this check is the one that holds where that policy is not installed,
and for a job written before the values changed. Pure.

- Volumes: `persistentVolumeClaim`, `configMap` and `emptyDir` (SAFE_VOLUME_TYPES), plus the types the admin
  adds (`volume_types`). Never by default: hostPath (the node's files and sockets), secret and projected (the
  namespace's Secrets, which the user may not read), csi, nfs and the like (storage reached by the node's
  credentials, not the user's).
- Images: each pattern is an image reference, or a prefix ending in `*` (`ghcr.io/memstrata/runtime:*`: any tag
  of that repository). `*` alone allows every image: the check is off.
- Commands: none but the runtime's own (RUNTIME_COMMAND, the image's entrypoint) unless the admin allows custom
  commands: a custom command in an allowed image still runs whatever it is told to.
"""
from __future__ import annotations

from dataclasses import dataclass

from memstrata.api.finetunejob import FineTuneJobSpec

SAFE_VOLUME_TYPES = ("persistentVolumeClaim", "configMap", "emptyDir")
RUNTIME_IMAGES = ("ghcr.io/memstrata/runtime:*", "ghcr.io/memstrata/runtime@sha256:*")
RUNTIME_COMMAND = ("memstrata", "pod")  # docker/runtime.Dockerfile: ENTRYPOINT + CMD
# Where a refusal tells the admin to look.
VALUES = "the chart's jobPolicy"


def image_allowed(image: str, patterns: tuple[str, ...]) -> bool:
    """Whether `image` is one of `patterns` (an exact reference, or a prefix ending in `*`)."""
    return any(image.startswith(p[:-1]) if p.endswith("*") else image == p for p in patterns)


@dataclass(frozen=True)
class JobPolicy:
    """What the admin opened beyond the safe defaults (the operator's flags; the chart's values `jobPolicy`)."""

    volume_types: tuple[str, ...] = ()
    """Volume types allowed beyond SAFE_VOLUME_TYPES (Kubernetes' field names: `hostPath`, `nfs`, `csi`...)."""
    images: tuple[str, ...] = RUNTIME_IMAGES
    """Image patterns a job may run; ("*",) allows any image."""
    custom_commands: bool = False
    """Whether spec.command may be anything but the runtime's own entrypoint."""

    def __post_init__(self) -> None:
        if not self.images:
            raise ValueError("job policy: no image pattern: no job could run (use '*' to allow every image)")
        for p in self.images:
            if not p.strip() or "*" in p[:-1]:
                raise ValueError(f"job policy: image pattern {p!r}: expected an image reference, or a prefix "
                                 "ending in a single '*'")
        for t in self.volume_types:
            if not t.isalnum() or not t[:1].islower():
                raise ValueError(f"job policy: volume type {t!r}: expected a field name of Kubernetes' Volume "
                                 "(e.g. hostPath, nfs, csi)")

    @property
    def allowed_volume_types(self) -> tuple[str, ...]:
        return SAFE_VOLUME_TYPES + tuple(t for t in self.volume_types if t not in SAFE_VOLUME_TYPES)

    def refusal(self, spec: FineTuneJobSpec) -> str | None:
        """Why the job may not run under this policy (naming the first field that asks too much), or None."""
        allowed = self.allowed_volume_types
        for i, volume in enumerate(spec.volumes):
            for kind in sorted(volume.model_extra or {}):
                if kind not in allowed:
                    return (f"spec.volumes[{i}].{kind}: volume type {kind} is not allowed for a FineTuneJob "
                            f"(allowed: {', '.join(allowed)}; {VALUES}.volumeTypes opens more)")
        if not image_allowed(spec.image, self.images):
            return (f"spec.image: {spec.image} is not allowed for a FineTuneJob (allowed: {', '.join(self.images)}; "
                    f"{VALUES}.images)")
        if spec.command is not None and tuple(spec.command) != RUNTIME_COMMAND and not self.custom_commands:
            return (f"spec.command: a custom command is not allowed for a FineTuneJob ({VALUES}.customCommands is "
                    f"false); leave it out to run the image's own `{' '.join(RUNTIME_COMMAND)}`")
        return None
