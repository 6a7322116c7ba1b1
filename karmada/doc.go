// Package karmada runs Karmada's own code (v1.18.2: pkg/util.BuildClusterConfig
// and the cluster proxy of pkg/util/proxy) against the real kube-apiserver of
// the end-to-end suite, behind a CONNECT proxy that requires each cluster's
// ProxyHeader, as is and on the pool. It is a module of its own so that
// Karmada's dependencies stay out of the library's go.mod.
package karmada
