package karmada

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"path"
	"sync"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/endpoints/request"

	clusterapis "github.com/karmada-io/karmada/pkg/apis/cluster"
	"github.com/karmada-io/karmada/pkg/util/proxy"

	"github.com/sharedtransport/sharedtransport"
)

// mode is how the front gets the transport for a proxied request.
type mode int

const (
	// connectCluster: Karmada's proxy.ConnectCluster, called per request as
	// the cluster proxy (karmada-aggregated-apiserver's proxy subresource,
	// karmada-search's cluster plugin) calls it: keep-alive off.
	connectCluster mode = iota
	// asIs: the aggregated path (pkg/registry/cluster/storage/aggregate.go):
	// GetTLSConfigForCluster, Location's transport (keep-alive off) and
	// NewThrottledUpgradeAwareProxyHandler, per request.
	asIs
	// keepAliveOn: the same with keep-alive on, as before Karmada PR 5610
	// (issue 5574): the transport Location built, DisableKeepAlives false.
	keepAliveOn
	// pooled: the same against patched Karmada (karmada/patches), whose
	// Location takes its transport from proxy.ClusterTransports, set to
	// the front's pool: the pool's TLSTransport of the settings Karmada's
	// transport carries.
	pooled
	// sharedOnce: the transport Location built for the first request,
	// keep-alive on, used for every request after (PR 5615's shape): Go's
	// transport as Karmada builds it, at its best, the control of pooled.
	sharedOnce
)

var modeNames = map[mode]string{connectCluster: "ConnectCluster as is", asIs: "Karmada as is (keep-alive off)",
	keepAliveOn: "Karmada, keep-alive on", pooled: "Karmada + TLSTransport", sharedOnce: "Karmada's transport, shared"}

func (m mode) String() string { return modeNames[m] }

// front is Karmada's proxy in front of one member cluster. The user a
// request comes from is its X-Remote-User header (an authenticated user of
// the Karmada API server in production).
type front struct {
	mode    mode
	pool    *sharedtransport.Pool
	secrets *secrets

	mu      sync.Mutex
	cluster *clusterapis.Cluster
	shared  http.RoundTripper // sharedOnce's
}

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	name := r.Header.Get("X-Remote-User")
	if name == "" {
		name = "tester"
	}
	r.Header.Del("X-Remote-User")
	ctx := request.WithUser(r.Context(), &user.DefaultInfo{Name: name, Groups: []string{user.AllAuthenticated}})
	r = r.WithContext(ctx)
	f.mu.Lock()
	cl := f.cluster.DeepCopy()
	f.mu.Unlock()
	resp := &responder{w: w}
	if f.mode == connectCluster {
		h, err := proxy.ConnectCluster(ctx, cl, r.URL.Path, f.secrets.get, resp)
		if err != nil {
			resp.Error(err)
			return
		}
		h.ServeHTTP(w, r)
		return
	}
	h, err := f.handler(r, cl, resp)
	if err != nil {
		resp.Error(err)
		return
	}
	h.ServeHTTP(w, r)
}

// handler is what Karmada builds per request in the front's mode, with the
// request's impersonation headers set as Karmada sets them.
func (f *front) handler(r *http.Request, cl *clusterapis.Cluster, resp *responder) (http.Handler, error) {
	ctx := r.Context()
	tlsConfig, err := proxy.GetTLSConfigForCluster(ctx, cl, f.secrets.get)
	if err != nil {
		return nil, err
	}
	// Location changes the NextProtos of the configuration it is handed.
	location, rt, err := proxy.Location(cl, tlsConfig.Clone())
	if err != nil {
		return nil, err
	}
	switch f.mode {
	case keepAliveOn:
		rt.(*http.Transport).DisableKeepAlives = false
	case sharedOnce:
		f.mu.Lock()
		if f.shared == nil {
			f.shared, err = karmadaTransport(cl, tlsConfig)
		}
		rt = f.shared
		f.mu.Unlock()
		if err != nil {
			return nil, err
		}
	case pooled:
		if !patched {
			return nil, fmt.Errorf("%s needs Karmada with karmada/patches (karmada/hack/test-patched.sh)", f.mode)
		}
	}
	sec, err := f.secrets.get(ctx, cl.Spec.ImpersonatorSecretRef.Namespace, cl.Spec.ImpersonatorSecretRef.Name)
	if err != nil {
		return nil, err
	}
	impersonateToken, err := proxy.ImpersonateToken(cl.Name, sec)
	if err != nil {
		return nil, err
	}
	requester, _ := request.UserFrom(ctx)
	r.Header.Set(authenticationv1.ImpersonateUserHeader, requester.GetName())
	r.Header.Set("Authorization", "bearer "+impersonateToken)
	location.Path = path.Join(location.Path, r.URL.Path)
	location.RawQuery = r.URL.RawQuery
	return proxy.NewThrottledUpgradeAwareProxyHandler(location, rt, true, false, resp), nil
}

// karmadaTransport builds the transport Karmada v1.18.2's Location builds
// for cl (createProxyTransport), keep-alive on: Go's transport as Karmada
// builds it, which a patched Location no longer returns.
func karmadaTransport(cl *clusterapis.Cluster, tlsConfig *tls.Config) (*http.Transport, error) {
	rt := utilnet.SetTransportDefaults(&http.Transport{TLSClientConfig: tlsConfig.Clone()})
	if cl.Spec.ProxyURL != "" {
		u, err := url.Parse(cl.Spec.ProxyURL)
		if err != nil {
			return nil, err
		}
		rt.Proxy = http.ProxyURL(u)
		rt.ProxyConnectHeader = proxy.ParseProxyHeaders(cl.Spec.ProxyHeader)
	}
	return rt, nil
}

// responder writes what Karmada's handlers report as a Status, as the
// Karmada API server's responder does.
type responder struct{ w http.ResponseWriter }

func (r *responder) Object(code int, obj runtime.Object) {
	r.w.Header().Set("Content-Type", "application/json")
	r.w.WriteHeader(code)
	json.NewEncoder(r.w).Encode(obj)
}

func (r *responder) Error(err error) {
	st := apierrors.NewInternalError(err).ErrStatus
	if s, ok := err.(apierrors.APIStatus); ok {
		st = s.Status()
	}
	if st.Code == 0 {
		st.Code = http.StatusInternalServerError
	}
	st.TypeMeta = metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}
	r.Object(int(st.Code), &st)
}

func httpClient() *http.Client { return &http.Client{Timeout: 60 * time.Second} }
