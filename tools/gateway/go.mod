// Pins the Gateway API Inference Extension whose InferencePool CRD the e2e cluster installs
// (docs/e2e.md). Nothing here is compiled: tools/build.sh downloads the module, asks `go list -m`
// for its directory and copies the CRD YAML out of it. Do not `go mod tidy` here: nothing
// imports the module, so tidy would drop the require line.
module epdserve.dev/tools/gateway

go 1.26.0

require sigs.k8s.io/gateway-api-inference-extension v1.6.2
