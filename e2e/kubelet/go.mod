module memstrata.dev/e2e/kubelet-stub

go 1.26.0

require (
	google.golang.org/grpc v1.79.3
	k8s.io/kubelet v0.36.4
)

require (
	golang.org/x/net v0.56.0 // indirect
	golang.org/x/sys v0.46.0 // indirect
	golang.org/x/text v0.39.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260128011058-8636f8732409 // indirect
	google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af // indirect
)
