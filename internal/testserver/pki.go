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

// CertSpec describes a certificate for (*CA).Issue or SelfSigned.
type CertSpec struct {
	// CommonName is the subject CN; for a client certificate kube-apiserver
	// takes it as the user name.
	CommonName string
	// Organization is the subject O; for a client certificate these are the
	// user's groups.
	Organization []string
	// Server adds ExtKeyUsageServerAuth; Client adds ExtKeyUsageClientAuth.
	// CA makes a CA certificate (key usage CertSign).
	Server, Client, CA bool
	DNSNames           []string
	IPAddresses        []net.IP
	// NotBefore and NotAfter default to now-1h and now+30 days.
	NotBefore, NotAfter time.Time
	// Key is the certificate's key; by default a new one. A certificate
	// issued over an existing key lets a test vary the certificate while
	// the key stays the same.
	Key *ecdsa.PrivateKey
}

// NewCA generates a self-signed CA with the given common name, valid for ten
// years.
func NewCA(commonName string) (*CA, error) {
	kp, err := SelfSigned(CertSpec{CommonName: commonName, CA: true, NotAfter: time.Now().Add(10 * 365 * 24 * time.Hour)})
	if err != nil {
		return nil, err
	}
	block, _ := pem.Decode(kp.KeyPEM)
	key, err := x509.ParseECPrivateKey(block.Bytes)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: kp.Cert, Key: key, certPEM: kp.CertPEM}, nil
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
	if !spec.Server && !spec.Client && !spec.CA {
		return nil, errors.New("testserver: CertSpec needs Server, Client or CA")
	}
	return issue(spec, ca.Cert, ca.Key)
}

// SelfSigned returns a certificate described by spec that signs itself: a
// CA, or a serving certificate a CA file pins.
func SelfSigned(spec CertSpec) (*KeyPair, error) {
	return issue(spec, nil, nil)
}

// issue signs spec with parent and its key, or with spec's own key when
// parent is nil.
func issue(spec CertSpec, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*KeyPair, error) {
	key := spec.Key
	if key == nil {
		var err error
		if key, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
			return nil, err
		}
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
		spec.NotAfter = now.Add(30 * 24 * time.Hour)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: spec.CommonName, Organization: spec.Organization},
		NotBefore:             spec.NotBefore,
		NotAfter:              spec.NotAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		DNSNames:              spec.DNSNames,
		IPAddresses:           spec.IPAddresses,
		BasicConstraintsValid: true,
		IsCA:                  spec.CA,
	}
	if spec.CA {
		tmpl.KeyUsage |= x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	}
	if spec.Server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if spec.Client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
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
