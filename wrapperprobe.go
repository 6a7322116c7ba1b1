// The config's wrapper probe: what the wrappers already in a config's
// WrapTransport do to the connection, found out at Wrap.

package sharedtransport

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"sync"
	"unsafe"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/transport"
)

// connectHeaderFor returns the headers cfg's CONNECT requests carry: those a
// wrapper already in cfg.WrapTransport sets on the transport below it, or else
// those WithProxyConnectHeader gives. Such a wrapper (Karmada's
// Spec.ProxyHeader clones the *http.Transport it is handed and sets
// ProxyConnectHeader on the clone) sits above the hook and is handed the
// pool's round tripper, so it would do nothing: the pool finds out what it
// does by running cfg.WrapTransport once, at Wrap, over a probe transport.
// share is false when the wrappers replace the transport in any other way:
// the pool cannot give that to shared connections, and dropping it silently
// would change what the config does.
func (p *Pool) connectHeaderFor(cfg *rest.Config) (h http.Header, fromWrappers, share bool) {
	if cfg.WrapTransport != nil {
		h, replaced, ok := probeWrappers(cfg.WrapTransport)
		if !ok {
			p.opts.logger.V(2).Info("Config passes through: a wrapper in its WrapTransport replaces the transport below it with more than CONNECT headers", "host", redactHost(cfg.Host))
			return nil, false, false
		}
		if replaced {
			return h, true, true
		}
	}
	if p.opts.connectHeader != nil {
		h = p.opts.connectHeader(cfg).Clone()
	}
	return h, false, true
}

// probeWrappers runs wrap over a probe transport. replaced reports that wrap
// handed back another *http.Transport, or changed the probe in place; ok
// that the result differs from the probe in its CONNECT headers at most (a
// static header: GetProxyConnectHeader is not recognised).
func probeWrappers(wrap transport.WrapperFunc) (h http.Header, replaced, ok bool) {
	// The probe has a TLS configuration, as client-go's transports do, for
	// wrappers that change theirs.
	probe := &http.Transport{Proxy: probeProxy, DialContext: probeDial, TLSClientConfig: &tls.Config{}}
	pristine := probe.Clone()
	out, ran := runWrappers(wrap, probe)
	if !ran {
		return nil, true, false
	}
	t := unwrapTransport(out)
	if t == nil || t == probe {
		// A wrapper may also change the transport it is handed in place:
		// the pool's round tripper would hide that change from it too.
		if !sameButConnectHeader(probe, pristine) || probe.GetProxyConnectHeader != nil {
			return nil, true, false
		}
		if probe.ProxyConnectHeader != nil {
			return probe.ProxyConnectHeader.Clone(), true, true
		}
		return nil, false, true
	}
	if t.GetProxyConnectHeader != nil || !sameButConnectHeader(t, probe) {
		return nil, true, false
	}
	return t.ProxyConnectHeader.Clone(), true, true
}

// runWrappers returns what wrap makes of probe; ran is false when it panics.
// A wrapper written for client-go's transports may not expect a probe, and
// what it does to theirs is then unknown.
func runWrappers(wrap transport.WrapperFunc, probe *http.Transport) (out http.RoundTripper, ran bool) {
	defer func() {
		if recover() != nil {
			out, ran = nil, false
		}
	}()
	return wrap(probe), true
}

func isProbe(rt http.RoundTripper) bool {
	t, ok := rt.(*http.Transport)
	return ok && t.Proxy != nil && reflect.ValueOf(t.Proxy).Pointer() == reflect.ValueOf(probeProxy).Pointer()
}

func probeProxy(*http.Request) (*url.URL, error) {
	return nil, errors.New("sharedtransport: probe transport")
}

func probeDial(context.Context, string, string) (net.Conn, error) {
	return nil, errors.New("sharedtransport: probe transport")
}

// sameButConnectHeader compares every exported field of two transports but
// ProxyConnectHeader and GetProxyConnectHeader; their TLS configurations
// (a clone's is a copy) must set nothing, as the probe's.
func sameButConnectHeader(a, b *http.Transport) bool {
	return sameFields(a, b, probeFields()) && tlsUnset(a.TLSClientConfig) && tlsUnset(b.TLSClientConfig)
}

// tlsUnset reports whether c is a TLS configuration that sets no exported
// field.
func tlsUnset(c *tls.Config) bool {
	if c == nil {
		return false
	}
	v := reflect.ValueOf(c).Elem()
	for _, i := range tlsFields() {
		if !v.Field(i).IsZero() {
			return false
		}
	}
	return true
}

// The fields compared, as indices computed once: reflect's StructField
// allocates, and the hook compares for every client it sees.
var (
	probeFields = sync.OnceValue(func() []int {
		return exportedFieldsBut(reflect.TypeFor[http.Transport](), "ProxyConnectHeader", "GetProxyConnectHeader", "TLSClientConfig")
	})
	tlsFields = sync.OnceValue(func() []int { return exportedFieldsBut(reflect.TypeFor[tls.Config]()) })
)

func exportedFieldsBut(t reflect.Type, skip ...string) []int {
	var fields []int
	for i := range t.NumField() {
		if f := t.Field(i); f.IsExported() && !slices.Contains(skip, f.Name) {
			fields = append(fields, i)
		}
	}
	return fields
}

// sameFields compares the given fields of two transports. Functions, maps
// and pointers are the same when they are the same value (one func value,
// one map, one pointee); everything else by value.
func sameFields(a, b *http.Transport, fields []int) bool {
	va, vb := reflect.ValueOf(a).Elem(), reflect.ValueOf(b).Elem()
	for _, i := range fields {
		fa, fb := va.Field(i), vb.Field(i)
		switch fa.Kind() {
		case reflect.Func:
			if *(*unsafe.Pointer)(unsafe.Pointer(fa.UnsafeAddr())) != *(*unsafe.Pointer)(unsafe.Pointer(fb.UnsafeAddr())) {
				return false
			}
		case reflect.Map, reflect.Pointer, reflect.Slice, reflect.Chan:
			if fa.Pointer() != fb.Pointer() || fa.Kind() == reflect.Slice && fa.Len() != fb.Len() {
				return false
			}
		default:
			if !fa.Equal(fb) {
				return false
			}
		}
	}
	return true
}
