# The project's test entry points. `make test` is the one test command:
# it needs root, the Debian packages from tests/cluster/install-deps and Go.
CLUSTER := tests/cluster

.PHONY: test unit cluster-build cluster-images cluster-up cluster-down agents-image

## test: build/reuse cluster binaries, cluster up, all cargo tests against it, cluster down
test:
	$(CLUSTER)/test-run

## unit: plain cargo test (cluster tests print "skipped")
unit:
	cargo test

## cluster-build: build or reuse kubernetes, etcd, helm and the OpenTelemetry Collector under /var/cache/agents-cluster
cluster-build:
	$(CLUSTER)/build

## cluster-images: build the pause and busybox image archives
cluster-images:
	$(CLUSTER)/images

## agents-image: build the agents image from the Dockerfile (static binary, buildah) and import it into the test cluster
agents-image:
	$(CLUSTER)/agents-image

## cluster-up: start the test cluster (kubeconfig /var/lib/agents-test-cluster/admin.kubeconfig)
cluster-up: cluster-build
	$(CLUSTER)/up

## cluster-down: stop the test cluster and remove its state
cluster-down:
	$(CLUSTER)/down
