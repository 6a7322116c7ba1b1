package testserver

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"time"
)

// CA is an in-memory certificate authority. All keys are ECDSA P-256, which
// keeps generation in the sub-millisecond range.
type CA struct {
	// Cert is the self-signed CA certificate.
	Cert *x509.Certificate
	// Key is the CA's private key.
	Key *ecdsa.PrivateKey

	certPEM []byte
}

// KeyPair is an issued certificate with its private key, PEM-encoded and parsed.
type KeyPair struct {
	CertPEM []byte
	KeyPEM  []byte
	Cert    *x509.Certificate
}

// TLSCertificate returns the pair as a tls.Certificate (with Leaf set).
func (kp *KeyPair) TLSCertificate() (tls.Certificate, error) {
	c, err := tls.X509KeyPair(kp.CertPEM, kp.KeyPEM)
	if err != nil {
		return tls.Certificate{}, err
	}
	c.Leaf = kp.Cert
	return c, nil
}

// CertSpec describes a certificate for (*CA).Issue.
type CertSpec struct {
	// CommonName is the subject CN; for a client certificate kube-apiserver
	// takes it as the user name.
	CommonName string
	// Organization is the subject O; for a client certificate these are the
	// user's groups.
	Organization []string
	// Server adds ExtKeyUsageServerAuth; Client adds ExtKeyUsageClientAuth.
	Server, Client bool
	DNSNames       []string
	IPAddresses    []net.IP
	// NotBefore and NotAfter default to now-1h and now+24h.
	NotBefore, NotAfter time.Time
}

// NewCA generates a self-signed CA with the given common name.
func NewCA(commonName string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: commonName},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{
		Cert:    cert,
		Key:     key,
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
	}, nil
}

// CertPEM returns the CA certificate, PEM-encoded.
func (ca *CA) CertPEM() []byte { return append([]byte(nil), ca.certPEM...) }

// Pool returns a new pool holding only this CA.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Issue signs a certificate described by spec.
func (ca *CA) Issue(spec CertSpec) (*KeyPair, error) {
	if !spec.Server && !spec.Client {
		return nil, errors.New("testserver: CertSpec needs Server or Client")
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	if spec.NotBefore.IsZero() {
		spec.NotBefore = now.Add(-time.Hour)
	}
	if spec.NotAfter.IsZero() {
		spec.NotAfter = now.Add(24 * time.Hour)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: spec.CommonName, Organization: spec.Organization},
		NotBefore:    spec.NotBefore,
		NotAfter:     spec.NotAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		DNSNames:     spec.DNSNames,
		IPAddresses:  spec.IPAddresses,
	}
	if spec.Server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if spec.Client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	return &KeyPair{
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
		Cert:    cert,
	}, nil
}

// IssueServer issues a serving certificate for 127.0.0.1, ::1 and localhost,
// plus any extra host names or IP addresses given.
func (ca *CA) IssueServer(extraHosts ...string) (*KeyPair, error) {
	spec := CertSpec{
		CommonName:  "testserver",
		Server:      true,
		DNSNames:    []string{"localhost"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")},
	}
	for _, h := range extraHosts {
		if ip := net.ParseIP(h); ip != nil {
			spec.IPAddresses = append(spec.IPAddresses, ip)
		} else {
			spec.DNSNames = append(spec.DNSNames, h)
		}
	}
	return ca.Issue(spec)
}

// IssueClient issues a client certificate for user (CN) in groups (O).
func (ca *CA) IssueClient(user string, groups ...string) (*KeyPair, error) {
	if user == "" {
		return nil, fmt.Errorf("testserver: empty user name")
	}
	return ca.Issue(CertSpec{CommonName: user, Organization: groups, Client: true})
}

func randomSerial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}
