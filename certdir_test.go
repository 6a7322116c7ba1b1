package sharedtransport

// Certificate files as a kubeconfig names them, written the way the real
// writers write them.

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// certDir holds a client certificate, key and CA as files, written the way
// one of the real writers writes them.
type certDir struct {
	dir           string
	cert, key, ca string // the paths a kubeconfig names
	layout        string
	generation    int
}

const (
	inPlace      = "in-place rewrite"
	renameOver   = "temp file renamed over"
	secretVolume = "secret volume ..data swap"
	deleteCreate = "delete, then create later"
	certThenKey  = "cert written before key"
)

func newCertDir(t testing.TB, layout string, kp *testserver.KeyPair, ca []byte) *certDir {
	t.Helper()
	return writeCertDir(t, t.TempDir(), layout, kp, ca)
}

// writeCredFiles writes a CA, certificate and key file into dir (created if
// missing); later writes rename new files over them.
func writeCredFiles(t testing.TB, dir string, ca []byte, kp *testserver.KeyPair) *certDir {
	t.Helper()
	return writeCertDir(t, dir, renameOver, kp, ca)
}

func writeCertDir(t testing.TB, dir, layout string, kp *testserver.KeyPair, ca []byte) *certDir {
	t.Helper()
	must(t, os.MkdirAll(dir, 0o700))
	d := &certDir{dir: dir, layout: layout,
		cert: filepath.Join(dir, "tls.crt"), key: filepath.Join(dir, "tls.key"), ca: filepath.Join(dir, "ca.crt")}
	if layout == secretVolume {
		for _, name := range []string{"tls.crt", "tls.key", "ca.crt"} {
			must(t, os.Symlink(filepath.Join("..data", name), filepath.Join(dir, name)))
		}
	}
	d.write(t, kp, ca)
	return d
}

func (d *certDir) config(host string) *rest.Config {
	c := &rest.Config{Host: host}
	c.CertFile, c.KeyFile, c.CAFile = d.cert, d.key, d.ca
	return c
}

// wrapped returns a config naming d's files for host, wrapped by p, and a
// clientset built from it.
func (d *certDir) wrapped(t testing.TB, p *Pool, host string) (*rest.Config, kubernetes.Interface) {
	t.Helper()
	cfg := d.config(host)
	must(t, p.Wrap(cfg))
	cs, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	return cfg, cs
}

// write replaces the files' content with kp and ca, as d's layout does it.
func (d *certDir) write(t testing.TB, kp *testserver.KeyPair, ca []byte) {
	t.Helper()
	d.generation++
	must := func(err error) {
		must(t, err)
	}
	switch d.layout {
	case secretVolume:
		// kubelet's AtomicWriter: a timestamped directory, a new ..data
		// symlink renamed over the old one, the old directory removed.
		ts := fmt.Sprintf("..2026_12_02_18_00_%02d.%d", d.generation, time.Now().UnixNano())
		must(os.Mkdir(filepath.Join(d.dir, ts), 0o755))
		must(os.WriteFile(filepath.Join(d.dir, ts, "tls.crt"), kp.CertPEM, 0o644))
		must(os.WriteFile(filepath.Join(d.dir, ts, "tls.key"), kp.KeyPEM, 0o600))
		must(os.WriteFile(filepath.Join(d.dir, ts, "ca.crt"), ca, 0o644))
		old, _ := os.Readlink(filepath.Join(d.dir, "..data"))
		must(os.Symlink(ts, filepath.Join(d.dir, "..data_tmp")))
		must(os.Rename(filepath.Join(d.dir, "..data_tmp"), filepath.Join(d.dir, "..data")))
		if old != "" {
			must(os.RemoveAll(filepath.Join(d.dir, old)))
		}
	case renameOver:
		for path, data := range map[string][]byte{d.cert: kp.CertPEM, d.key: kp.KeyPEM, d.ca: ca} {
			writeAtomic(t, path, data)
		}
	case deleteCreate:
		if d.generation > 1 {
			for _, path := range []string{d.cert, d.key} {
				must(os.Remove(path))
			}
			time.Sleep(time.Second) // the files are missing meanwhile
		}
		must(os.WriteFile(d.ca, ca, 0o644))
		must(os.WriteFile(d.cert, kp.CertPEM, 0o644))
		must(os.WriteFile(d.key, kp.KeyPEM, 0o600))
	case certThenKey:
		must(os.WriteFile(d.ca, ca, 0o644))
		must(os.WriteFile(d.cert, kp.CertPEM, 0o644))
		if d.generation > 1 {
			time.Sleep(500 * time.Millisecond) // torn pair, longer than the debounce
		}
		must(os.WriteFile(d.key, kp.KeyPEM, 0o600))
	default: // inPlace: truncate, then write in several pieces
		for path, data := range map[string][]byte{d.ca: ca, d.cert: kp.CertPEM, d.key: kp.KeyPEM} {
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
			must(err)
			half := len(data) / 2
			_, err = f.Write(data[:half])
			must(err)
			must(f.Sync())
			time.Sleep(5 * time.Millisecond)
			_, err = f.Write(data[half:])
			must(err)
			must(f.Close())
		}
	}
}

// restore puts the good files back, whatever a badFile did.
func (c *certDir) restore(t testing.TB, ca []byte, kp *testserver.KeyPair) {
	t.Helper()
	for _, p := range []string{c.ca, c.cert, c.key} {
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			must(t, os.Remove(p))
		}
	}
	c.write(t, kp, ca)
}
