# The Helm chart and the operator benchmark (helm itself is built by mk/cluster.mk).
# Neither is part of `make test`: the chart's checks run inside the e2e suite, and
# benchmarks are run on purpose.
HELM := $(MEMSTRATA_K8S_BIN)/helm

.PHONY: chart-lint chart-template bench-operator
chart-lint: cluster-bins
	@$(TIMED) chart-lint $(HELM) lint --strict charts/memstrata

chart-template: cluster-bins
	@$(HELM) template memstrata charts/memstrata --namespace memstrata-system --include-crds --kube-version $(K8S_VERSION)

# 500 FineTuneJobs and 500 batch/v1 Jobs at once on 50 kwok nodes; writes
# benchmarks/results/operator.json and operator.md.
bench-operator: install cluster-bins
	@$(TIMED) bench-operator $(PY) benchmarks/operator/run.py $(BENCH_ARGS)
