package e2e

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
)

// The suite's certificates come from internal/testserver's PKI; kube-apiserver
// serves these names besides loopback's, as a cluster's certificate would.
var servingHosts = []string{"kubernetes", "kubernetes.default", "kubernetes.default.svc"}

// serviceAccountKey returns a PEM RSA private key for signing service-account
// tokens; kube-apiserver reads the public half from the same file.
func serviceAccountKey() ([]byte, error) {
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)}), nil
}
