// An identity's TLS material (CA bundle, client certificate and key): read,
// validated, and built into a generation of transports configured as
// client-go configures its own. Torn, mismatched or out-of-date material is
// rejected with an error that names the file and says what to do.

package sharedtransport

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"
)

// clockSkew is how far in the future a certificate's NotBefore may lie and
// still be taken: this machine's clock may run behind the signer's.
// kube-controller-manager backdates what it signs by as much.
const clockSkew = 5 * time.Minute

// digest is how material enters an identity's key and is compared.
type digest [sha256.Size]byte

func digestOf(b []byte) digest {
	if len(b) == 0 {
		return digest{}
	}
	return sha256.Sum256(b)
}

// material is one version of an identity's TLS material.
type material struct {
	caPEM, certPEM, keyPEM []byte
	cert                   *tls.Certificate // the pair as checkMaterial parsed it; nil without one
}

func (m *material) equal(o *material) bool {
	return bytes.Equal(m.caPEM, o.caPEM) && bytes.Equal(m.certPEM, o.certPEM) && bytes.Equal(m.keyPEM, o.keyPEM)
}

// sources are where an identity's CA and client certificate come from: as
// in client-go, files are reloaded only when named without inline data (for
// the certificate, both halves); a mix is read once.
type sources struct {
	caFile, certFile, keyFile string // absolute paths, watched
	caData, certData, keyData []byte // inline, or read once
}

// loadMaterial reads src's files and validates all its material at the
// time clock gives. Errors name the file and what is wrong, never what it
// holds.
func loadMaterial(src *sources, clock func() time.Time) (*material, error) {
	m, err := readMaterial(src)
	if err == nil {
		m, err = checkRead(src, m, clock)
	}
	return m, err
}

// maxMaterialFile bounds what is read of a certificate, key or CA file: a
// bundle of every public root CA is about 250 KB.
const maxMaterialFile = 4 << 20

// dataOrFile returns inline data, or the content of file when there is none:
// client-go's rule for material it does not reload.
func dataOrFile(data []byte, file, what string) ([]byte, error) {
	if len(data) > 0 || file == "" {
		return data, nil
	}
	return readFile(file, what)
}

// readFile reads a regular file of at most maxMaterialFile bytes; anything
// else is refused unread (O_NONBLOCK: opening a named pipe does not wait). A
// read the kernel holds (a hung network mount) holds its caller, as it holds
// client-go's own read.
func readFile(path, what string) ([]byte, error) {
	refuse := func(format string, args ...any) error {
		return &materialError{file: path, err: fmt.Errorf("sharedtransport: "+format, args...)}
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, refuse("read %s file %q: %w", what, path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, refuse("read %s file %q: %w", what, path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, refuse("%s file %q is not a regular file (mode %v): point the config at the file itself", what, path, fi.Mode())
	}
	b, err := io.ReadAll(io.LimitReader(f, maxMaterialFile+1))
	if err != nil {
		return nil, refuse("read %s file %q: %w", what, path, err)
	}
	if len(b) > maxMaterialFile {
		return nil, refuse("%s file %q holds more than the %d bytes a certificate file may hold", what, path, maxMaterialFile)
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return nil, refuse("%s file %q is empty", what, path)
	}
	return b, nil
}

// checkRead checks m, read from src's files. A writer swapping certificate
// and key between their reads gives a torn pair, so a mismatch is read once
// more before it counts. It returns the material checked last, nil if the
// second read failed.
func checkRead(src *sources, m *material, clock func() time.Time) (*material, error) {
	err := checkMaterial(src, m, clock())
	var refused *materialError
	if !errors.As(err, &refused) || !refused.pair || src.certFile == "" {
		return m, err
	}
	if m, err = readMaterial(src); err != nil {
		return nil, err
	}
	return m, checkMaterial(src, m, clock())
}

// readMaterial reads src's files, unvalidated, beside its inline data.
func readMaterial(src *sources) (*material, error) {
	m := &material{caPEM: src.caData, certPEM: src.certData, keyPEM: src.keyData}
	var err error
	if src.caFile != "" {
		m.caPEM, err = readFile(src.caFile, "CA")
	}
	if err == nil && src.certFile != "" {
		m.certPEM, err = readFile(src.certFile, "client certificate")
	}
	if err == nil && src.certFile != "" {
		m.keyPEM, err = readFile(src.keyFile, "client key")
	}
	if err != nil {
		return nil, err
	}
	return m, nil
}

// materialError is material refused, and the file it came from ("" for
// inline data); pair: a certificate and key that do not form a valid pair.
type materialError struct {
	file string
	pair bool
	err  error
}

func (e *materialError) Error() string { return e.err.Error() }
func (e *materialError) Unwrap() error { return e.err }

// checkMaterial validates m, src's material, at now: a CA bundle that can
// verify a server, and a certificate that matches its key and is valid now.
// It sets m.cert when the certificate is accepted.
func checkMaterial(src *sources, m *material, now time.Time) error {
	if len(m.caPEM) > 0 {
		if err := checkCABundle(m.caPEM, now); err != nil {
			return &materialError{file: src.caFile, err: fmt.Errorf("sharedtransport: %s: %w", describe(src.caFile, "inline CA data"), err)}
		}
	}
	if len(m.certPEM) == 0 && len(m.keyPEM) == 0 {
		return nil
	}
	cert, err := tls.X509KeyPair(m.certPEM, m.keyPEM)
	if err != nil {
		return &materialError{file: src.certFile, pair: true, err: fmt.Errorf("sharedtransport: %s and %s do not form a valid pair (%v): check that the key belongs to the certificate and that neither is half-written",
			describe(src.certFile, "inline client certificate data"), describe(src.keyFile, "inline client key data"), err)}
	}
	if cert.Leaf == nil { // GODEBUG x509keypairleaf=0: a main module older than Go 1.23
		if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return &materialError{file: src.certFile, err: fmt.Errorf("sharedtransport: %s: %w", describe(src.certFile, "inline client certificate data"), err)}
		}
	}
	if err := checkValidity(cert.Leaf, now); err != nil {
		return &materialError{file: src.certFile, err: fmt.Errorf("sharedtransport: client certificate %s %w", describe(src.certFile, "(inline data)"), err)}
	}
	m.cert = &cert
	return nil
}

// checkValidity reports a certificate outside its validity window at now.
// A NotBefore up to clockSkew ahead of now is accepted.
func checkValidity(c *x509.Certificate, now time.Time) error {
	window := fmt.Sprintf("valid from %s until %s", stamp(c.NotBefore), stamp(c.NotAfter))
	switch {
	case now.After(c.NotAfter):
		return fmt.Errorf("has expired (%s; it is %s here): write a current certificate", window, stamp(now))
	case now.Add(clockSkew).Before(c.NotBefore):
		return fmt.Errorf("is not valid yet (%s; it is %s here, more than the %v of clock skew allowed): check the clocks of this machine and of the signer", window, stamp(now), clockSkew)
	}
	return nil
}

// checkCABundle accepts what client-go accepts as a CA bundle (PEM blocks
// among any text; blocks that are not certificates, or do not parse, are
// skipped, as crypto/x509 skips them) when one of its certificates can
// verify a server now. Unlike client-go it rejects a bundle whose last block
// is torn: a CA file caught mid-write must not replace a good one.
func checkCABundle(b []byte, now time.Time) error {
	if tornBlock(b) {
		return errors.New("holds an incomplete PEM block at its end, a -----BEGIN line with no -----END line after it (a write in progress?)")
	}
	// why is the most telling reason why no block so far verifies a server now.
	why, rank := errors.New("holds no PEM certificate"), 0
	worse := func(r int, err error) {
		if r >= rank {
			why, rank = err, r
		}
	}
	for rest := b; ; {
		var block *pem.Block
		if block, rest = pem.Decode(rest); block == nil {
			if bytes.Contains(rest, []byte("-----BEGIN")) {
				worse(1, errors.New("holds a PEM block that does not decode (its END line names another type, or its body is not base64), and no CA certificate for servers before it"))
			}
			return why
		}
		if block.Type != "CERTIFICATE" || len(block.Headers) != 0 {
			worse(1, fmt.Errorf("holds a %q PEM block where CA certificates are expected", block.Type))
			continue
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			worse(2, fmt.Errorf("holds no certificate that parses: %w", err))
			continue
		}
		if !canVerifyServers(cert) {
			worse(3, errors.New("holds no CA certificate for servers: none of its certificates allows server authentication, so it can verify no server (a client certificate, or a CA for clients only, in the CA file?)"))
			continue
		}
		if err := checkValidity(cert, now); err != nil {
			worse(4, fmt.Errorf("holds no CA certificate valid now, every one has expired or is not valid yet: CA %q %w", cert.Subject.CommonName, err))
			continue
		}
		return nil
	}
}

// tornBlock reports a last block cut short as encoding/pem reads it: a
// BEGIN line with no END line after it, as a write in progress leaves a
// file. Text between blocks, and a block pem.Decode skips, are client-go's
// to ignore, and the pool's.
func tornBlock(b []byte) bool {
	begin := bytes.LastIndex(b, []byte("\n-----BEGIN"))
	if begin < 0 && !bytes.HasPrefix(b, []byte("-----BEGIN")) {
		return false
	}
	_, end, ok := bytes.Cut(b[begin+1:], []byte("\n-----END"))
	line, _, _ := bytes.Cut(end, []byte("\n"))
	return !ok || !bytes.Contains(line, []byte("-----"))
}

// canVerifyServers reports whether cert's extended key usages allow server
// authentication: crypto/x509 holds every certificate of a chain, the root
// included, to them, so a CA restricted to clients verifies no server.
func canVerifyServers(cert *x509.Certificate) bool {
	if len(cert.ExtKeyUsage) == 0 && len(cert.UnknownExtKeyUsage) == 0 {
		return true
	}
	for _, u := range cert.ExtKeyUsage {
		switch u {
		case x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageAny,
			// crypto/x509 takes the server-gated-crypto usages as server authentication.
			x509.ExtKeyUsageMicrosoftServerGatedCrypto, x509.ExtKeyUsageNetscapeServerGatedCrypto:
			return true
		}
	}
	return false
}

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }

func describe(file, inline string) string {
	if file == "" {
		return inline
	}
	return fmt.Sprintf("file %q", file)
}
