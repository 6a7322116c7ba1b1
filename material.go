// Reading and validating an identity's TLS material (CA bundle, client
// certificate and key): reads are bounded in size and in time, and torn,
// mismatched or out-of-date material is rejected with an error that names
// the file and says what to do.

package sharedtransport

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sync"
	"syscall"
	"time"
)

// maxMaterialFile bounds what is read of a certificate, key or CA file. A
// bundle of every public root CA is about 250 KB; a file far larger is not
// TLS material (a log, a disk image) and is not read to its end.
const maxMaterialFile = 4 << 20

// clockSkew is how far in the future a certificate's NotBefore may lie and
// still be taken: this machine's clock may run behind the signer's.
// kube-controller-manager backdates the certificates it signs by the same
// amount.
const clockSkew = 5 * time.Minute

// material is one version of an identity's TLS material: what a generation
// of its transport hands out in handshakes.
type material struct {
	caPEM, certPEM, keyPEM []byte
	cert                   *tls.Certificate // the pair as checkMaterial parsed it; nil without one
}

func (m *material) equal(o *material) bool {
	return bytes.Equal(m.caPEM, o.caPEM) && bytes.Equal(m.certPEM, o.certPEM) && bytes.Equal(m.keyPEM, o.keyPEM)
}

// loadMaterial reads an identity's files and validates everything, inline
// data included. Errors name the file and say what is wrong, never what it
// holds.
func (p *Pool) loadMaterial(id *identity) (*material, error) {
	m, err := p.readMaterial(id, nil)
	if err == nil {
		m, err = p.checkRead(id, m, p.opts.now(), nil)
	}
	return m, err
}

// checkRead checks m, read from id's files, at now. The reads of a
// certificate and its key are not atomic: a writer swapping both (kubelet's
// ..data symlink) between them gives a torn pair, so a mismatch is read once
// more before it counts. It returns the material checked last, nil if the
// second read failed.
func (p *Pool) checkRead(id *identity, m *material, now time.Time, done <-chan struct{}) (*material, error) {
	err := checkMaterial(id, m, now)
	if !errors.As(err, new(*pairError)) || id.key.certFile == "" {
		return m, err
	}
	if m, err = p.readMaterial(id, done); err != nil {
		return nil, err
	}
	return m, checkMaterial(id, m, p.opts.now())
}

// readMaterial reads id's files, without validating them, and takes its
// inline data as it is. The read is bounded: see stuckReads.
func (p *Pool) readMaterial(id *identity, done <-chan struct{}) (*material, error) {
	m := &material{caPEM: id.caData, certPEM: id.certData, keyPEM: id.keyData}
	var files []fileToRead
	if id.key.caFile != "" {
		files = append(files, fileToRead{id.key.caFile, "CA", &m.caPEM})
	}
	if id.key.certFile != "" {
		files = append(files, fileToRead{id.key.certFile, "client certificate", &m.certPEM}, fileToRead{id.key.keyFile, "client key", &m.keyPEM})
	}
	if err := p.reads.read(p.opts.readTimeout, done, files); err != nil {
		return nil, err
	}
	return m, nil
}

// pairError is a certificate and key that do not form a valid pair.
type pairError struct{ msg string }

func (e *pairError) Error() string { return e.msg }

// checkMaterial validates m, id's material, at now: a CA bundle that can
// verify a server, and a certificate that matches its key and is valid now.
// It sets m.cert when the certificate is accepted.
func checkMaterial(id *identity, m *material, now time.Time) error {
	if len(m.caPEM) > 0 {
		if err := checkCABundle(m.caPEM, now); err != nil {
			return fmt.Errorf("sharedtransport: %s: %w", describe(id.key.caFile, "inline CA data"), err)
		}
	}
	if len(m.certPEM) == 0 && len(m.keyPEM) == 0 {
		return nil
	}
	cert, err := tls.X509KeyPair(m.certPEM, m.keyPEM)
	if err != nil {
		return &pairError{fmt.Sprintf("sharedtransport: %s and %s do not form a valid pair (%v): check that the key belongs to the certificate and that neither is half-written",
			describe(id.key.certFile, "inline client certificate data"), describe(id.key.keyFile, "inline client key data"), err)}
	}
	if cert.Leaf == nil { // GODEBUG x509keypairleaf=0: a main module older than Go 1.23
		if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return fmt.Errorf("sharedtransport: %s: %w", describe(id.key.certFile, "inline client certificate data"), err)
		}
	}
	if err := checkValidity(cert.Leaf, now); err != nil {
		return fmt.Errorf("sharedtransport: client certificate %s %w", describe(id.key.certFile, "(inline data)"), err)
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
// with any text around them; blocks that are not certificates, or do not
// parse, are skipped, as crypto/x509 skips them), as long as one of its
// certificates can verify a server now. Unlike client-go it rejects a torn
// block, a "-----BEGIN" without its "-----END": a CA file caught mid-write
// must not replace a good one.
func checkCABundle(b []byte, now time.Time) error {
	if tornBlock(b) {
		return errors.New("holds an incomplete PEM block, a -----BEGIN without its -----END (a write in progress?)")
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

// tornBlock reports a "-----BEGIN" without an "-----END" before the next
// one, or a last block that the end of b cuts short: a write in progress cuts
// a file at its end.
func tornBlock(b []byte) bool {
	begin := []byte("-----BEGIN")
	blocks := bytes.Split(b, begin)
	for _, block := range blocks[1:] {
		if !bytes.Contains(block, []byte("-----END")) {
			return true
		}
	}
	last, _ := pem.Decode(b[max(bytes.LastIndex(b, begin), 0):])
	return len(blocks) > 1 && last == nil
}

// canVerifyServers reports whether cert can end a server's chain: as a CA or
// pinned directly (a self-signed serving certificate, which client-go takes
// as a root too), as long as its extended key usages allow server
// authentication. crypto/x509 holds every certificate of a chain, the root
// included, to its extended key usages, so a CA restricted to client
// authentication verifies no server.
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

// dataOrFile returns inline data, or the content of file when there is none:
// client-go's rule for material it does not reload. The file is read as every
// certificate file is, bounded in time (see stuckReads).
func (p *Pool) dataOrFile(data []byte, file, what string) ([]byte, error) {
	if len(data) > 0 || file == "" {
		return data, nil
	}
	var b []byte
	err := p.reads.read(p.opts.readTimeout, nil, []fileToRead{{file, what, &b}})
	return b, err
}

// readFile reads a regular file of at most maxMaterialFile bytes. Anything
// else is refused before it is read: a named pipe would wait for a writer
// (O_NONBLOCK keeps its open from waiting), /dev/zero would never end.
func readFile(path, what string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: read %s file %q: %w", what, path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: read %s file %q: %w", what, path, err)
	}
	switch mode := fi.Mode(); {
	case mode.IsDir():
		return nil, fmt.Errorf("sharedtransport: read %s file %q: is a directory", what, path)
	case !mode.IsRegular():
		return nil, fmt.Errorf("sharedtransport: %s file %q is %s, not a regular file: point the config at the file itself", what, path, fileKind(mode))
	}
	b, err := io.ReadAll(io.LimitReader(f, maxMaterialFile+1))
	if err != nil {
		return nil, fmt.Errorf("sharedtransport: read %s file %q: %w", what, path, err)
	}
	if len(b) > maxMaterialFile {
		return nil, fmt.Errorf("sharedtransport: %s file %q holds more than the %d bytes a certificate file may hold", what, path, maxMaterialFile)
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return nil, fmt.Errorf("sharedtransport: %s file %q is empty", what, path)
	}
	return b, nil
}

func fileKind(m fs.FileMode) string {
	switch {
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	default:
		return "a special file"
	}
}

// stuckReads bounds the reads of one pool's certificate files in time. A
// read that does not return (a hung network mount, a FUSE daemon that does not
// answer) cannot be cancelled: it is left to finish on its goroutine while its
// caller moves on, and its file is refused until it has, so a hung file holds
// one goroutine and one thread however often it is asked for.
type stuckReads struct {
	mu    sync.Mutex
	since map[string]time.Time // files whose read outlived its wait, and since when
}

// fileToRead is one file of a read, and where its content goes.
type fileToRead struct {
	path, what string
	into       *[]byte
}

// read reads files in order until they are read, timeout has passed, or done
// is closed (ErrClosed).
func (s *stuckReads) read(timeout time.Duration, done <-chan struct{}, files []fileToRead) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for _, f := range files {
		s.mu.Lock()
		since, stuck := s.since[f.path]
		s.mu.Unlock()
		if stuck {
			return fmt.Errorf("sharedtransport: read %s file %q: an earlier read has not returned for %v (a hung network file system?)",
				f.what, f.path, time.Since(since).Round(time.Second))
		}
		var b []byte
		got := make(chan error, 1)
		go func() {
			var err error
			b, err = readFile(f.path, f.what)
			got <- err
			s.mark(f.path, false)
		}()
		var err error
		select {
		case err = <-got:
			if err != nil {
				return err
			}
			*f.into = b
			continue
		case <-done:
			err = ErrClosed
		case <-deadline.C:
			err = fmt.Errorf("sharedtransport: read %s file %q: no answer after %v (a hung network file system?)", f.what, f.path, timeout)
		}
		s.mark(f.path, true)
		select {
		case <-got: // it returned after all
			s.mark(f.path, false)
		default:
		}
		return err
	}
	return nil
}

func (s *stuckReads) mark(path string, stuck bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch _, ok := s.since[path]; {
	case stuck && !ok:
		if s.since == nil {
			s.since = map[string]time.Time{}
		}
		s.since[path] = time.Now()
	case !stuck:
		delete(s.since, path)
	}
}
