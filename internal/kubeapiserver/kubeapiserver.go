// Package kubeapiserver starts the real etcd and kube-apiserver the
// end-to-end suites run against, from the binaries e2e/hack/kube-apiserver.sh
// builds and caches (KUBE_APISERVER and ETCD point at others), with a fresh
// PKI: a serving CA, a client CA with an admin certificate in system:masters,
// and a service-account signing key.
package kubeapiserver

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// Version is the kube-apiserver the suites use, as the build script caches it.
const Version = "v1.37.2"

const hint = "build or reuse them with e2e/hack/kube-apiserver.sh, or point KUBE_APISERVER and ETCD at existing binaries"

// Cluster is a running etcd and kube-apiserver.
type Cluster struct {
	URL       string // https://127.0.0.1:port
	ServingCA *testserver.CA
	Admin     *testserver.KeyPair // CN admin, O system:masters
	Dir       string
	procs     []*exec.Cmd
}

// Binaries returns the paths of kube-apiserver and etcd.
func Binaries() (apiserver, etcd string, err error) {
	apiserver = os.Getenv("KUBE_APISERVER")
	if apiserver == "" {
		cache := os.Getenv("SHAREDTRANSPORT_CACHE")
		if cache == "" {
			base, err := os.UserCacheDir()
			if err != nil {
				return "", "", err
			}
			cache = filepath.Join(base, "sharedtransport")
		}
		apiserver = filepath.Join(cache, "kube-apiserver-"+Version)
	}
	if st, err := os.Stat(apiserver); err != nil || st.Mode()&0o111 == 0 {
		return "", "", fmt.Errorf("kube-apiserver %s not found at %s: %s", Version, apiserver, hint)
	}
	if etcd = os.Getenv("ETCD"); etcd == "" {
		if etcd, err = exec.LookPath("etcd"); err != nil {
			return "", "", fmt.Errorf("etcd is not on PATH (Debian package etcd-server): %s", hint)
		}
	}
	return apiserver, etcd, nil
}

// Start starts etcd and kube-apiserver in a new temporary directory and
// waits until the server is ready. extraArgs are added to kube-apiserver's.
func Start(extraArgs ...string) (c *Cluster, err error) {
	apiserverBin, etcdBin, err := Binaries()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "sharedtransport-kube-")
	if err != nil {
		return nil, err
	}
	c = &Cluster{Dir: dir}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	files, err := c.writePKI()
	if err != nil {
		return nil, err
	}
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(ports[0])
	peer := "http://127.0.0.1:" + strconv.Itoa(ports[1])
	if err := c.start(etcdBin, "etcd.log", "--name=kube", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peer, "--initial-advertise-peer-urls="+peer,
		"--initial-cluster=kube="+peer, "--log-level=warn"); err != nil {
		return nil, err
	}
	c.URL = "https://127.0.0.1:" + strconv.Itoa(ports[2])
	args := append([]string{
		"--etcd-servers=" + etcdURL, "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--endpoint-reconciler-type=none", "--secure-port=" + strconv.Itoa(ports[2]),
		"--cert-dir=" + filepath.Join(dir, "certs"),
		"--tls-cert-file=" + files["serving.crt"], "--tls-private-key-file=" + files["serving.key"],
		"--client-ca-file=" + files["client-ca.crt"], "--authorization-mode=RBAC", "--anonymous-auth=false",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + files["sa.key"], "--service-account-signing-key-file=" + files["sa.key"],
		"--service-cluster-ip-range=10.96.0.0/24", "--profiling=false",
		"--max-requests-inflight=1000", "--max-mutating-requests-inflight=500", "--v=1",
	}, extraArgs...)
	if err := c.start(apiserverBin, "kube-apiserver.log", args...); err != nil {
		return nil, err
	}
	return c, c.waitReady(120 * time.Second)
}

// writePKI writes the cluster's certificates and keys and returns their
// paths by name.
func (c *Cluster) writePKI() (map[string]string, error) {
	clientCA, err := testserver.NewCA("kube-client-ca")
	if err != nil {
		return nil, err
	}
	if c.ServingCA, err = testserver.NewCA("kube-serving-ca"); err != nil {
		return nil, err
	}
	serving, err := c.ServingCA.IssueServer("kubernetes", "kubernetes.default", "kubernetes.default.svc")
	if err != nil {
		return nil, err
	}
	if c.Admin, err = clientCA.IssueClient("admin", "system:masters"); err != nil {
		return nil, err
	}
	sa, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	files := map[string][]byte{
		"client-ca.crt": clientCA.CertPEM(),
		"serving.crt":   serving.CertPEM,
		"serving.key":   serving.KeyPEM,
		"sa.key":        pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(sa)}),
	}
	paths := map[string]string{}
	for name, data := range files {
		paths[name] = filepath.Join(c.Dir, name)
		if err := os.WriteFile(paths[name], data, 0o600); err != nil {
			return nil, err
		}
	}
	return paths, nil
}

// AdminTLS is a TLS configuration that trusts the serving CA and presents
// the admin certificate.
func (c *Cluster) AdminTLS() (*tls.Config, error) {
	cert, err := tls.X509KeyPair(c.Admin.CertPEM, c.Admin.KeyPEM)
	if err != nil {
		return nil, err
	}
	return &tls.Config{RootCAs: c.ServingCA.Pool(), Certificates: []tls.Certificate{cert}}, nil
}

func (c *Cluster) waitReady(timeout time.Duration) error {
	tc, err := c.AdminTLS()
	if err != nil {
		return err
	}
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: tc, DisableKeepAlives: true}}
	deadline := time.Now().Add(timeout)
	last := ""
	for time.Now().Before(deadline) {
		resp, err := hc.Get(c.URL + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("kube-apiserver not ready after %v (last: %s); its log is %s", timeout, last, filepath.Join(c.Dir, "kube-apiserver.log"))
}

// Close stops the processes and removes the directory.
func (c *Cluster) Close() {
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
		_ = p.Wait()
	}
	c.procs = nil
	os.RemoveAll(c.Dir)
}

// start starts bin in a process group of its own that the kernel kills when
// the starting thread dies: every process is started from one goroutine
// locked to its thread for the life of the test binary.
func (c *Cluster) start(bin, logName string, args ...string) error {
	logf, err := os.Create(filepath.Join(c.Dir, logName))
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	starterOnce.Do(func() { go startLoop() })
	done := make(chan error)
	starter <- func() { done <- cmd.Start() }
	if err := <-done; err != nil {
		return fmt.Errorf("start %s: %w", bin, err)
	}
	c.procs = append(c.procs, cmd)
	return nil
}

var (
	starter     = make(chan func())
	starterOnce sync.Once
)

func startLoop() {
	runtime.LockOSThread() // never unlocked: the thread lives as long as the process
	for f := range starter {
		f()
	}
}

func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
