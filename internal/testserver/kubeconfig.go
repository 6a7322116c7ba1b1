package testserver

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Kubeconfig describes a kubeconfig file for WriteKubeconfig.
type Kubeconfig struct {
	// Server URL, e.g. (*Server).URL().
	Server string
	// CAPEM is the certificate authority for the server; empty means
	// insecure-skip-tls-verify.
	CAPEM []byte
	// Client certificate and key; both empty for a token-only user.
	CertPEM, KeyPEM []byte
	// Token is a bearer token, optional.
	Token string
	// Inline puts certificate data in the file (certificate-authority-data,
	// client-certificate-data, client-key-data). Otherwise the PEM files are
	// written beside the kubeconfig as <name>.ca.crt, <name>.client.crt and
	// <name>.client.key (absolute paths in the file).
	Inline bool
	// Name of the cluster, user and context; default "testserver".
	Name string
}

// Paths are the files WriteKubeconfig wrote.
type Paths struct {
	Kubeconfig, CA, Cert, Key string
}

// WriteKubeconfig writes a kubeconfig (and, unless Inline, its PEM files) to
// path.
func WriteKubeconfig(path string, k Kubeconfig) (Paths, error) {
	if k.Name == "" {
		k.Name = "testserver"
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return Paths{}, err
	}
	paths := Paths{Kubeconfig: abs}
	cluster := &clientcmdapi.Cluster{Server: k.Server}
	user := &clientcmdapi.AuthInfo{Token: k.Token}
	if k.Inline {
		cluster.CertificateAuthorityData = k.CAPEM
		user.ClientCertificateData = k.CertPEM
		user.ClientKeyData = k.KeyPEM
	} else {
		base := strings.TrimSuffix(abs, filepath.Ext(abs))
		write := func(suffix string, data []byte, mode os.FileMode) (string, error) {
			if len(data) == 0 {
				return "", nil
			}
			p := base + suffix
			return p, os.WriteFile(p, data, mode)
		}
		if paths.CA, err = write(".ca.crt", k.CAPEM, 0o644); err != nil {
			return Paths{}, err
		}
		if paths.Cert, err = write(".client.crt", k.CertPEM, 0o644); err != nil {
			return Paths{}, err
		}
		if paths.Key, err = write(".client.key", k.KeyPEM, 0o600); err != nil {
			return Paths{}, err
		}
		cluster.CertificateAuthority = paths.CA
		user.ClientCertificate = paths.Cert
		user.ClientKey = paths.Key
	}
	if len(k.CAPEM) == 0 {
		cluster.InsecureSkipTLSVerify = true
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[k.Name] = cluster
	cfg.AuthInfos[k.Name] = user
	cfg.Contexts[k.Name] = &clientcmdapi.Context{Cluster: k.Name, AuthInfo: k.Name}
	cfg.CurrentContext = k.Name
	if err := clientcmd.WriteToFile(*cfg, abs); err != nil {
		return Paths{}, fmt.Errorf("testserver: write kubeconfig: %w", err)
	}
	return paths, nil
}

// WriteKubeconfig writes a kubeconfig for this server and client (nil: no
// certificate) to path; see Kubeconfig.Inline for where the PEM data goes.
func (s *Server) WriteKubeconfig(path string, client *KeyPair, inline bool) (Paths, error) {
	k := Kubeconfig{Server: s.URL(), CAPEM: s.ca.CertPEM(), Inline: inline}
	if client != nil {
		k.CertPEM, k.KeyPEM = client.CertPEM, client.KeyPEM
	}
	return WriteKubeconfig(path, k)
}

// RestConfig returns a rest.Config for this server with client's certificate
// and key inline (nil: no certificate).
func (s *Server) RestConfig(client *KeyPair) *rest.Config {
	cfg := &rest.Config{
		Host:            s.URL(),
		TLSClientConfig: rest.TLSClientConfig{CAData: s.ca.CertPEM()},
	}
	if client != nil {
		cfg.CertData, cfg.KeyData = client.CertPEM, client.KeyPEM
	}
	return cfg
}
