package karmada

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	clusterapis "github.com/karmada-io/karmada/pkg/apis/cluster"

	"github.com/sharedtransport/sharedtransport/internal/connectproxy"
	"github.com/sharedtransport/sharedtransport/internal/kubeapiserver"
)

// The member cluster every test talks to: the real kube-apiserver, reached
// through a CONNECT proxy that answers 407 to a CONNECT without the
// cluster's ProxyHeader.
var (
	kube       *kubeapiserver.Cluster
	admin      *kubernetes.Clientset
	proxyToken string // what the member's Spec.ProxyHeader carries
	// token is a service account's that may impersonate: Karmada's
	// impersonator token, and the member token BuildClusterConfig uses.
	token string
)

const (
	secretNamespace = "karmada-cluster"
	saNamespace     = "karmada-system"
	saName          = "karmada-impersonator"
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	var err error
	if kube, err = kubeapiserver.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "karmada: FAIL: %v\n", err)
		return 1
	}
	defer kube.Close()
	if err := prepare(); err != nil {
		fmt.Fprintf(os.Stderr, "karmada: FAIL: preparing the member: %v\n", err)
		return 1
	}
	return m.Run()
}

// prepare creates the impersonator service account with the right to
// impersonate, lets every authenticated user read config maps, and takes a
// token of the service account.
func prepare() error {
	cfg := &rest.Config{Host: kube.URL, QPS: -1}
	cfg.CAData = kube.ServingCA.CertPEM()
	cfg.CertData, cfg.KeyData = kube.Admin.CertPEM, kube.Admin.KeyPEM
	var err error
	if admin, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := createObjects(ctx); err != nil {
		return err
	}
	tr, err := admin.CoreV1().ServiceAccounts(saNamespace).CreateToken(ctx, saName,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	token = tr.Status.Token
	proxyToken = "Basic " + base64.StdEncoding.EncodeToString([]byte("member1:proxy-secret"))
	return nil
}

func createObjects(ctx context.Context) error {
	rules := map[string][]rbacv1.PolicyRule{
		"impersonator":     {{APIGroups: []string{""}, Resources: []string{"users", "groups", "serviceaccounts"}, Verbs: []string{"impersonate"}}},
		"configmap-reader": {{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list", "watch"}}},
	}
	subjects := map[string]rbacv1.Subject{
		"impersonator":     {Kind: "ServiceAccount", Name: saName, Namespace: saNamespace},
		"configmap-reader": {Kind: "Group", Name: "system:authenticated", APIGroup: rbacv1.GroupName},
	}
	for _, ns := range []string{saNamespace, "default"} {
		_, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		if err != nil && ns != "default" {
			return fmt.Errorf("namespace %s: %w", ns, err)
		}
	}
	if _, err := admin.CoreV1().ServiceAccounts(saNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: saName}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	for name, r := range rules {
		if _, err := admin.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: r}, metav1.CreateOptions{}); err != nil {
			return err
		}
		b := &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
			Subjects:   []rbacv1.Subject{subjects[name]},
		}
		if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, b, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

func ptr[T any](v T) *T { return &v }

// secrets is the Secrets Karmada reads a cluster's credentials from, as
// its secret getter sees them.
type secrets struct {
	mu sync.Mutex
	m  map[string]*corev1.Secret
}

func (s *secrets) get(_ context.Context, namespace, name string) (*corev1.Secret, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sec, ok := s.m[namespace+"/"+name]
	if !ok {
		return nil, fmt.Errorf("secret %s/%s not found", namespace, name)
	}
	return sec.DeepCopy(), nil
}

// setCABundle replaces the caBundle of the cluster's secret.
func (s *secrets) setCABundle(cluster string, bundle []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[secretNamespace+"/"+cluster].Data[clusterapis.SecretCADataKey] = bundle
}

// member is a cluster named name at endpoint behind proxy, as Karmada's
// API holds it, with its secrets (CA bundle caPEM).
func member(name, endpoint string, proxy *connectproxy.Proxy, caPEM []byte) (*clusterapis.Cluster, *secrets) {
	cl := &clusterapis.Cluster{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: clusterapis.ClusterSpec{
			APIEndpoint:           endpoint,
			SecretRef:             &clusterapis.LocalSecretReference{Namespace: secretNamespace, Name: name},
			ImpersonatorSecretRef: &clusterapis.LocalSecretReference{Namespace: secretNamespace, Name: name + "-impersonator"},
			ProxyURL:              proxy.URL(),
			ProxyHeader:           map[string]string{"Proxy-Authorization": proxyToken},
		},
	}
	s := &secrets{m: map[string]*corev1.Secret{
		secretNamespace + "/" + name: {Data: map[string][]byte{
			clusterapis.SecretTokenKey: []byte(token), clusterapis.SecretCADataKey: caPEM,
		}},
		secretNamespace + "/" + name + "-impersonator": {Data: map[string][]byte{clusterapis.SecretTokenKey: []byte(token)}},
	}}
	return cl, s
}

// newProxy is the CONNECT proxy in front of the member: it refuses tunnels
// without the cluster's ProxyHeader.
func newProxy(t testing.TB) *connectproxy.Proxy {
	t.Helper()
	p, err := connectproxy.Start(connectproxy.Options{RequireHeader: "Proxy-Authorization", RequireValues: []string{proxyToken}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}
