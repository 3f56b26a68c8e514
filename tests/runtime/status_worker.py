"""`memstrata run` as `memstrata pod` drives it, in its own process (one DeepSpeed per process), recording
every RuntimeReport the pod would patch into the job's status:
`status_worker.py JOB.yaml NVME_DIR REPORT.json STATUS.jsonl`.
"""
from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    job_file, nvme, report_json, status = (Path(a) for a in sys.argv[1:5])
    from memstrata.api import load_job
    from memstrata.api.report import RuntimeReport
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.local import run_local, torch_gpus

    job = load_job(job_file)
    plan = plan_job(job.spec, local_inventory(nvme, gpus=torch_gpus))
    if not plan.feasible:
        raise SystemExit(f"does not fit: {plan.verdict()}")
    with status.open("w") as out:
        def on_report(report: RuntimeReport) -> None:
            out.write(report.model_dump_json(by_alias=True) + "\n")

        return run_local(job, plan, nvme_path=nvme, report_json=report_json, on_report=on_report)


if __name__ == "__main__":
    sys.exit(main())
