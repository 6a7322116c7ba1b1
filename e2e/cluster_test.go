package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

const (
	kubeVersion = "v1.37.2"
	// testNamespace holds the objects the tests create.
	testNamespace = "e2e"
	buildHint     = "build or reuse them with: e2e/hack/kube-apiserver.sh (or run e2e/run.sh); " +
		"or point KUBE_APISERVER and ETCD at existing binaries"
)

// Users with client certificates. admin and the rotation users are in
// system:masters; alice, bob and carol only have what every authenticated user
// has (enough for SelfSubjectReview).
var clientUsers = map[string][]string{
	"admin": {"system:masters"},
	"alice": nil,
	"bob":   nil,
	"carol": nil,
}

// cluster is the etcd and kube-apiserver the suite runs against.
type cluster struct {
	dir           string
	apiserverBin  string
	etcdBin       string
	etcdPort      int
	etcdPeerPort  int
	port          int // kube-apiserver secure port
	clientCA      *testserver.CA
	clientCAFile  string
	saKeyFile     string
	servingCAFile string // the CA the kubeconfigs name; always the original serving CA

	mu        sync.Mutex
	servingCA *testserver.CA // CA of the serving certificate in use
	serving   *testserver.KeyPair
	origCA    *testserver.CA
	origPair  *testserver.KeyPair
	etcd      *proc
	apiserver *proc
	starts    int

	clients map[string]*testserver.KeyPair
}

var theCluster *cluster

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) (code int) {
	c, err := startCluster()
	defer func() {
		if c != nil {
			c.shutdown(code != 0)
		}
	}()
	defer func() {
		if r := recover(); r != nil {
			fmt.Fprintf(os.Stderr, "e2e: panic: %v\n", r)
			code = 1
		}
	}()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: FAIL: %v\n", err)
		return 1
	}
	theCluster = c
	return m.Run()
}

func findBinaries() (apiserver, etcd string, err error) {
	apiserver = os.Getenv("KUBE_APISERVER")
	if apiserver == "" {
		cache := os.Getenv("SHAREDTRANSPORT_CACHE")
		if cache == "" {
			base := os.Getenv("XDG_CACHE_HOME")
			if base == "" {
				home, _ := os.UserHomeDir()
				base = filepath.Join(home, ".cache")
			}
			cache = filepath.Join(base, "sharedtransport")
		}
		apiserver = filepath.Join(cache, "kube-apiserver-"+kubeVersion)
	}
	var missing []string
	if st, err := os.Stat(apiserver); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
		missing = append(missing, "kube-apiserver "+kubeVersion+" (looked at "+apiserver+")")
	}
	etcd = os.Getenv("ETCD")
	if etcd == "" {
		if p, err := exec.LookPath("etcd"); err == nil {
			etcd = p
		} else {
			missing = append(missing, "etcd (not on PATH; Debian package etcd-server)")
		}
	} else if _, err := os.Stat(etcd); err != nil {
		missing = append(missing, "etcd (ETCD="+etcd+" does not exist)")
	}
	if len(missing) > 0 {
		return "", "", fmt.Errorf("missing binaries: %s; %s", strings.Join(missing, ", "), buildHint)
	}
	return apiserver, etcd, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func writeFile(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o600)
}

// replaceFile writes data next to path and renames it over path, so readers
// never see a partial file.
func replaceFile(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func startCluster() (*cluster, error) {
	apiserverBin, etcdBin, err := findBinaries()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "sharedtransport-e2e-")
	if err != nil {
		return nil, err
	}
	c := &cluster{dir: dir, apiserverBin: apiserverBin, etcdBin: etcdBin, clients: map[string]*testserver.KeyPair{}}
	if err := c.generatePKI(); err != nil {
		return c, err
	}
	for _, p := range []*int{&c.etcdPort, &c.etcdPeerPort, &c.port} {
		if *p, err = freePort(); err != nil {
			return c, err
		}
	}
	if err := c.startEtcd(); err != nil {
		return c, err
	}
	if err := c.startAPIServer(); err != nil {
		return c, err
	}
	if err := c.prepare(); err != nil {
		return c, err
	}
	return c, nil
}

func (c *cluster) generatePKI() error {
	var err error
	if c.clientCA, err = testserver.NewCA("e2e-client-ca"); err != nil {
		return err
	}
	if c.origCA, err = testserver.NewCA("e2e-serving-ca"); err != nil {
		return err
	}
	if c.origPair, err = c.origCA.IssueServer(servingHosts...); err != nil {
		return err
	}
	c.servingCA, c.serving = c.origCA, c.origPair
	pki := filepath.Join(c.dir, "pki")
	c.clientCAFile = filepath.Join(pki, "client-ca.crt")
	c.servingCAFile = filepath.Join(pki, "serving-ca.crt")
	c.saKeyFile = filepath.Join(pki, "sa.key")
	sa, err := serviceAccountKey()
	if err != nil {
		return err
	}
	for path, data := range map[string][]byte{
		c.clientCAFile:  c.clientCA.CertPEM(),
		c.servingCAFile: c.origCA.CertPEM(),
		c.saKeyFile:     sa,
	} {
		if err := writeFile(path, data); err != nil {
			return err
		}
	}
	for user, groups := range clientUsers {
		kp, err := c.clientCA.IssueClient(user, groups...)
		if err != nil {
			return err
		}
		c.clients[user] = kp
		if err := writeFile(filepath.Join(pki, user+".crt"), kp.CertPEM); err != nil {
			return err
		}
		if err := writeFile(filepath.Join(pki, user+".key"), kp.KeyPEM); err != nil {
			return err
		}
	}
	return nil
}

func (c *cluster) startEtcd() error {
	client := fmt.Sprintf("http://127.0.0.1:%d", c.etcdPort)
	peer := fmt.Sprintf("http://127.0.0.1:%d", c.etcdPeerPort)
	p, err := startProc("etcd", filepath.Join(c.dir, "etcd.log"), c.etcdBin,
		"--name=e2e",
		"--data-dir="+filepath.Join(c.dir, "etcd-data"),
		"--listen-client-urls="+client,
		"--advertise-client-urls="+client,
		"--listen-peer-urls="+peer,
		"--initial-advertise-peer-urls="+peer,
		"--initial-cluster=e2e="+peer,
		"--logger=zap",
		"--log-level=warn",
	)
	if err != nil {
		return err
	}
	c.etcd = p
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if !p.running() {
			return fmt.Errorf("etcd exited: %v\n%s", p.err, tail(p.log, 30))
		}
		resp, err := http.Get(client + "/health")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && bytes.Contains(body, []byte(`"true"`)) {
				return nil
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("etcd not healthy after 30s\n%s", tail(p.log, 30))
}

// startAPIServer starts kube-apiserver with the current serving certificate
// and waits for /readyz.
func (c *cluster) startAPIServer() error {
	c.mu.Lock()
	c.starts++
	n := c.starts
	certFile := filepath.Join(c.dir, "pki", fmt.Sprintf("serving-%d.crt", n))
	keyFile := filepath.Join(c.dir, "pki", fmt.Sprintf("serving-%d.key", n))
	serving := c.serving
	c.mu.Unlock()
	if err := writeFile(certFile, serving.CertPEM); err != nil {
		return err
	}
	if err := writeFile(keyFile, serving.KeyPEM); err != nil {
		return err
	}
	args := []string{
		"--etcd-servers=" + fmt.Sprintf("http://127.0.0.1:%d", c.etcdPort),
		"--etcd-prefix=/registry-e2e",
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--endpoint-reconciler-type=none", // the default reconciler rejects a loopback advertise address
		"--secure-port=" + strconv.Itoa(c.port),
		"--cert-dir=" + filepath.Join(c.dir, "apiserver-certs"),
		"--tls-cert-file=" + certFile,
		"--tls-private-key-file=" + keyFile,
		"--client-ca-file=" + c.clientCAFile,
		"--authorization-mode=RBAC",
		"--anonymous-auth=false",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + c.saKeyFile,
		"--service-account-signing-key-file=" + c.saKeyFile,
		"--service-cluster-ip-range=10.96.0.0/24",
		"--profiling=false",
		"--max-requests-inflight=1000",
		"--max-mutating-requests-inflight=500",
		"--v=1",
	}
	p, err := startProc("kube-apiserver", filepath.Join(c.dir, "kube-apiserver.log"), c.apiserverBin, args...)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.apiserver = p
	c.mu.Unlock()
	return c.waitReady(90 * time.Second)
}

// adminHTTP returns an HTTP client that trusts the current serving CA and
// authenticates as admin; it is independent of client-go and the library.
func (c *cluster) adminHTTP() (*http.Client, error) {
	c.mu.Lock()
	ca := c.servingCA
	c.mu.Unlock()
	admin := c.clients["admin"]
	cert, err := tls.X509KeyPair(admin.CertPEM, admin.KeyPEM)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			TLSClientConfig:   &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}},
			DisableKeepAlives: true,
		},
	}, nil
}

func (c *cluster) url() string { return fmt.Sprintf("https://127.0.0.1:%d", c.port) }

func (c *cluster) waitReady(timeout time.Duration) error {
	hc, err := c.adminHTTP()
	if err != nil {
		return err
	}
	c.mu.Lock()
	p := c.apiserver
	c.mu.Unlock()
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		if !p.running() {
			return fmt.Errorf("kube-apiserver exited: %v\n%s", p.err, tail(p.log, 40))
		}
		resp, err := hc.Get(c.url() + "/readyz")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, lastLines(string(body), 5))
		} else {
			last = err.Error()
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("kube-apiserver not ready after %v (last: %s)\n%s", timeout, last, tail(p.log, 40))
}

// prepare creates the test namespace once the server is ready.
func (c *cluster) prepare() error {
	cfg, err := clientcmd.BuildConfigFromFlags("", c.kubeconfig("admin", false))
	if err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{})
		if err == nil || apierrors.IsAlreadyExists(err) {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("create namespace %s: %w", testNamespace, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for { // the bootstrap controller creates "default" shortly after readiness
		if _, err := cs.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err == nil {
			return nil
		} else if ctx.Err() != nil {
			return fmt.Errorf("namespace default: %w", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// killAPIServer kills kube-apiserver (SIGKILL to its process group).
func (c *cluster) killAPIServer() {
	c.mu.Lock()
	p := c.apiserver
	c.mu.Unlock()
	if p != nil {
		p.kill()
	}
}

// restartAPIServer kills kube-apiserver and starts it on the same port with
// the given serving CA and certificate (nil: keep the current ones).
func (c *cluster) restartAPIServer(ca *testserver.CA, serving *testserver.KeyPair) error {
	c.killAPIServer()
	if ca != nil {
		c.mu.Lock()
		c.servingCA, c.serving = ca, serving
		c.mu.Unlock()
	}
	return c.startAPIServer()
}

func (c *cluster) shutdown(failed bool) {
	c.mu.Lock()
	a, e := c.apiserver, c.etcd
	c.mu.Unlock()
	if a != nil {
		a.stop(10 * time.Second)
	}
	if e != nil {
		e.stop(10 * time.Second)
	}
	killAll()
	if failed {
		if a != nil {
			fmt.Fprintf(os.Stderr, "e2e: last lines of kube-apiserver.log:\n%s\n", tail(a.log, 40))
		}
		if e != nil {
			fmt.Fprintf(os.Stderr, "e2e: last lines of etcd.log:\n%s\n", tail(e.log, 20))
		}
	}
	if os.Getenv("E2E_KEEP") != "" {
		fmt.Fprintf(os.Stderr, "e2e: kept %s\n", c.dir)
		return
	}
	os.RemoveAll(c.dir)
}

// kubeconfig writes (once) and returns a kubeconfig for a user, with the CA,
// client certificate and key either as file paths or inline data.
func (c *cluster) kubeconfig(user string, inline bool) string {
	name := user + "-files.kubeconfig"
	if inline {
		name = user + "-inline.kubeconfig"
	}
	path := filepath.Join(c.dir, "kubeconfig", name)
	if _, err := os.Stat(path); err == nil {
		return path
	}
	pki := filepath.Join(c.dir, "pki")
	auth := &clientcmdapi.AuthInfo{}
	cl := &clientcmdapi.Cluster{Server: c.url()}
	if inline {
		kp := c.clients[user]
		auth.ClientCertificateData, auth.ClientKeyData = kp.CertPEM, kp.KeyPEM
		cl.CertificateAuthorityData = c.origCA.CertPEM()
	} else {
		auth.ClientCertificate = filepath.Join(pki, user+".crt")
		auth.ClientKey = filepath.Join(pki, user+".key")
		cl.CertificateAuthority = c.servingCAFile
	}
	if err := writeKubeconfig(path, cl, auth); err != nil {
		panic(err)
	}
	return path
}

func writeKubeconfig(path string, cl *clientcmdapi.Cluster, auth *clientcmdapi.AuthInfo) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["e2e"] = cl
	cfg.AuthInfos["user"] = auth
	cfg.Contexts["e2e"] = &clientcmdapi.Context{Cluster: "e2e", AuthInfo: "user"}
	cfg.CurrentContext = "e2e"
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return clientcmd.WriteToFile(*cfg, path)
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	return lastLines(string(b), n)
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// cl returns the running cluster or fails the test.
func cl(t *testing.T) *cluster {
	t.Helper()
	if theCluster == nil {
		t.Fatal(errors.New("no cluster (TestMain did not start one); " + buildHint))
	}
	return theCluster
}
