//go:build tools

// Package tools pins the Kueue release the e2e tests run against the real API server (e2e/kueue).
package tools

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
