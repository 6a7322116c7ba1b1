// What the pool reads from client-go's transports to show them alike: which
// function a certificate, proxy or dial callback is, and what client-go's
// closures and reloaders captured (the config, the files, the dialer). A
// reading that does not find what it expects recognises nothing, and a
// transport not recognised is not shown alike: its client keeps client-go's
// transport.

package sharedtransport

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/net/http2"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/transport"
	"k8s.io/client-go/util/connrotation"
)

// readsCertFiles reports whether c's client certificate comes from client-go's
// certificate-file reloader, which re-reads files the pool may not watch.
func readsCertFiles(c *tls.Config) bool {
	if c == nil || c.GetClientCertificate == nil {
		return false
	}
	fn := runtime.FuncForPC(reflect.ValueOf(c.GetClientCertificate).Pointer())
	return fn == nil || strings.Contains(fn.Name(), "dynamicClientCert")
}

// readsFilesOf reports whether got's client certificate comes from client-go's
// certificate-file reloader reading id's certificate and key files. The
// reloader (client-go's dynamicClientCert, a type the pool cannot name) keeps
// the function reading the files just before the connrotation dialer got
// dials with; that function is transport.TLSConfigFor's, whose config names
// the files.
func readsFilesOf(got *http.Transport, id *identity) bool {
	c := got.TLSClientConfig
	if id.certFile == "" || c == nil || c.GetClientCertificate == nil || !dialInspection() ||
		reflect.ValueOf(got.DialContext).Pointer() != rotDialerCode {
		return false
	}
	fn := runtime.FuncForPC(reflect.ValueOf(c.GetClientCertificate).Pointer())
	if fn == nil || fn.Name() != "k8s.io/client-go/transport.(*dynamicClientCert).GetClientCertificate-fm" {
		return false
	}
	reloader := certClosureWord(c.GetClientCertificate, 1) // the method value's receiver
	dialer := uintptr(unsafe.Pointer(receiverOf[connrotation.Dialer](got.DialContext)))
	word := unsafe.Sizeof(uintptr(0))
	for i := uintptr(1); i < maxReloaderWords; i++ {
		// Words are compared as integers: some of the reloader's (its
		// mutex) are not pointers, and must not be loaded as one.
		if *(*uintptr)(unsafe.Add(reloader, i*word)) != dialer {
			continue
		}
		// The word before the dialer is the function reading the files in
		// every client-go this was checked against (v0.31 to v0.37). A word
		// that cannot be a function value (zero, in the never-mapped first
		// page, unaligned) ends the look before it is read as one.
		if w := *(*uintptr)(unsafe.Add(reloader, (i-1)*word)); w < 1<<12 || w%word != 0 {
			return false
		}
		_, _, cfg, ok := tlsConfigForCaptures(*(*certFunc)(unsafe.Add(reloader, (i-1)*word)))
		if !ok || !cfg.TLS.ReloadTLSFiles {
			return false
		}
		cert, err1 := filepath.Abs(cfg.TLS.CertFile)
		key, err2 := filepath.Abs(cfg.TLS.KeyFile)
		return err1 == nil && err2 == nil && cert == id.certFile && key == id.keyFile
	}
	return false
}

// maxReloaderWords bounds the search for the dialer in client-go's
// certificate-file reloader: it lies within its first words (the sixth in
// client-go v0.31, the ninth in v0.37).
const maxReloaderWords = 12

// clientGoCertificate reports whether c's client certificate, if any, is
// shown to be what client-go presents for a config of id: its certificate-file
// reloader, its static certificate (inline data: fixed for good, so what it
// presents when compared it presents later) for an identity without an exec
// plugin, or id's exec plugin's own certificate holder. transport.TLSConfigFor
// hands out one function for the last two and for any GetCertHolder a caller
// gives it (a wrapper inside the hook, a transport of the config's own), so
// the function's name is not enough: what it captured tells which.
func clientGoCertificate(c *tls.Config, id *identity) bool {
	if c.GetClientCertificate == nil {
		return true
	}
	fn := runtime.FuncForPC(reflect.ValueOf(c.GetClientCertificate).Pointer())
	if fn == nil || !strings.HasPrefix(fn.Name(), "k8s.io/client-go/transport.") {
		return false
	}
	if readsCertFiles(c) {
		return true
	}
	static, loader, cfg, ok := tlsConfigForCaptures(c.GetClientCertificate)
	switch {
	case !ok || loader:
		return false
	case id.getCert == nil:
		return static
	}
	return !static && cfg.TLS.GetCertHolder == id.getCert
}

// tlsConfigForCaptures reads what the certificate function f, when it is
// transport.TLSConfigFor's, captured: whether it has a static certificate
// (which it presents whatever else it has), a certificate-file loader, and
// the transport.Config whose GetCertHolder it asks otherwise. ok is false for
// any other function, or when the closure's layout is not as
// certClosureLayout found it.
func tlsConfigForCaptures(f certFunc) (static, loader bool, cfg *transport.Config, ok bool) {
	l := certClosureLayout()
	if !l.ok || reflect.ValueOf(f).Pointer() != l.code {
		return false, false, nil, false
	}
	cfg = (*transport.Config)(certClosureWord(f, l.config))
	return certClosureWord(f, l.static) != nil, certClosureWord(f, l.loader) != nil, cfg, cfg != nil
}

type certFunc = func(*tls.CertificateRequestInfo) (*tls.Certificate, error)

// certClosureWord returns word i of f's closure record: the code pointer, then
// what f captured (see closureOf).
func certClosureWord(f certFunc, i int) unsafe.Pointer {
	rec := *(*unsafe.Pointer)(unsafe.Pointer(&f))
	return *(*unsafe.Pointer)(unsafe.Add(rec, uintptr(i)*unsafe.Sizeof(uintptr(0))))
}

type certClosure struct {
	ok                     bool
	code                   uintptr // TLSConfigFor's certificate function
	static, loader, config int     // the words of its closure record holding each capture
}

// certClosureCaptures is how many variables transport.TLSConfigFor's
// certificate function captures: the static certificate, the file loader and
// the config.
const certClosureCaptures = 3

// certClosureLayout finds where transport.TLSConfigFor's certificate function
// keeps what it captured, from two functions it builds here: one with a
// static certificate, one with a certificate holder. Anything not found as
// expected leaves every such function unrecognised, and configs presenting
// one pass through.
var certClosureLayout = sync.OnceValue(func() certClosure {
	certPEM, keyPEM, err := selfSignedPair()
	if err != nil {
		return certClosure{}
	}
	staticCfg := &transport.Config{TLS: transport.TLSConfig{CertData: certPEM, KeyData: keyPEM}}
	holderCfg := &transport.Config{TLS: transport.TLSConfig{GetCertHolder: &transport.GetCertHolder{GetCert: func() (*tls.Certificate, error) { return nil, nil }}}}
	s, err1 := transport.TLSConfigFor(staticCfg)
	h, err2 := transport.TLSConfigFor(holderCfg)
	if err1 != nil || err2 != nil || s == nil || h == nil || s.GetClientCertificate == nil || h.GetClientCertificate == nil {
		return certClosure{}
	}
	sf, hf := s.GetClientCertificate, h.GetClientCertificate
	l := certClosure{code: reflect.ValueOf(sf).Pointer(), static: -1, loader: -1, config: -1}
	if reflect.ValueOf(hf).Pointer() != l.code {
		return certClosure{}
	}
	cert, err := sf(&tls.CertificateRequestInfo{})
	if err != nil || cert == nil {
		return certClosure{}
	}
	for i := 1; i <= certClosureCaptures; i++ {
		sw, hw := certClosureWord(sf, i), certClosureWord(hf, i)
		switch {
		case sw == unsafe.Pointer(cert) && hw == nil && l.static < 0:
			l.static = i
		case sw == unsafe.Pointer(staticCfg) && hw == unsafe.Pointer(holderCfg) && l.config < 0:
			l.config = i
		case sw == nil && hw == nil && l.loader < 0:
			l.loader = i
		default:
			return certClosure{}
		}
	}
	l.ok = l.static > 0 && l.loader > 0 && l.config > 0
	return l
})

// selfSignedPair returns a throwaway certificate and key, PEM-encoded.
func selfSignedPair() (certPEM, keyPEM []byte, err error) {
	pub, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, pub, key)
	if err != nil {
		return nil, nil, err
	}
	pkcs8, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pkcs8}), nil
}

// clientGoUpgrades reports whether every function t hands a negotiated
// protocol's connections to (TLSNextProto: HTTP/2) is the one HTTP/2 as
// client-go configures it registers. One of anyone else's (a transport of the
// config's own) carries every request on such a connection, and may change
// it: the pool's connections would not.
func clientGoUpgrades(t *http.Transport) bool {
	if t.Protocols != nil {
		t = t.Clone() // settled: net/http registers its HTTP/2 at first use
	}
	for _, f := range t.TLSNextProto {
		if !slices.Contains(http2Upgrades(), reflect.ValueOf(f).Pointer()) {
			return false
		}
	}
	return true
}

// http2Upgrades is the code of the functions x/net's HTTP/2, which client-go
// configures, registers in a transport's TLSNextProto (net/http's own, where
// x/net hands HTTP/2 to it).
var http2Upgrades = sync.OnceValue(func() []uintptr {
	t := &http.Transport{TLSClientConfig: &tls.Config{}}
	if _, err := http2.ConfigureTransports(t); err != nil {
		return nil
	}
	settleProtocols(t)
	var codes []uintptr
	for _, f := range t.TLSNextProto {
		codes = append(codes, reflect.ValueOf(f).Pointer())
	}
	return codes
})

// clientGoTransport unwraps rt to the *http.Transport client-go built, through
// client-go's own holders (its cache's garbage-collection and CA-reload
// holders) only: a wrapper of anyone else's between client-go and the hook
// (inserted with transport.Wrappers before the hook) is a layer the pool must
// not replace, so such a round tripper passes through.
func clientGoTransport(rt http.RoundTripper) *http.Transport {
	for range 4 {
		if t, ok := rt.(*http.Transport); ok {
			return t
		}
		w, ok := rt.(utilnet.RoundTripperWrapper)
		if !ok {
			return nil
		}
		if name := clientGoHolder(rt); name != "trackedTransport" && name != "atomicTransportHolder" {
			return nil
		}
		rt = w.WrappedRoundTripper()
	}
	return nil
}

// httpTransport unwraps rt to the *http.Transport client-go built, or nil.
// client-go hands WrapTransport its TLS transport wrapped (the cache's
// garbage-collection and CA-reload holders), so a bare type assertion is not
// enough.
func httpTransport(rt http.RoundTripper) *http.Transport {
	for range 8 {
		switch t := rt.(type) {
		case *http.Transport:
			return t
		case utilnet.RoundTripperWrapper:
			rt = t.WrappedRoundTripper()
		default:
			return nil
		}
	}
	return nil
}

// clientGoHolder names the type of rt when it is one of client-go's transport
// package's own round trippers (a pointer to a struct there), or "".
func clientGoHolder(rt http.RoundTripper) string {
	t := reflect.TypeOf(rt)
	if t == nil || t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct || t.Elem().PkgPath() != "k8s.io/client-go/transport" {
		return ""
	}
	return t.Elem().Name()
}

// caFileHolder reports whether rt is (or wraps) client-go's CA-reloading
// holder (client-go v0.36+, ClientsAllowCARotation), and the CA file it
// re-reads, made absolute; file is "" when the holder's layout is not as
// expected. Such a holder's roots are that file's, refreshed on client-go's
// own schedule: what they are now says nothing about later.
func caFileHolder(rt http.RoundTripper) (file string, holder bool) {
	for range 8 {
		if clientGoHolder(rt) == "atomicTransportHolder" {
			f := reflect.ValueOf(rt).Elem().FieldByName("caFile")
			if f.Kind() != reflect.String || f.String() == "" {
				return "", true
			}
			abs, err := filepath.Abs(f.String())
			if err != nil {
				return "", true
			}
			return abs, true
		}
		w, ok := rt.(utilnet.RoundTripperWrapper)
		if !ok {
			return "", false
		}
		rt = w.WrappedRoundTripper()
	}
	return "", false
}

// envProxierCode is the code of the proxy function client-go's transports use
// for configs without Proxy.
var envProxierCode = reflect.ValueOf(utilnet.NewProxierWithNoProxyCIDR(http.ProxyFromEnvironment)).Pointer()

func isEnvProxier(proxy func(*http.Request) (*url.URL, error)) bool {
	return proxy != nil && reflect.ValueOf(proxy).Pointer() == envProxierCode
}

// routesByEnvironment reports whether proxy is shown to route by the
// environment: http.ProxyFromEnvironment itself, which is what client-go's
// transports use for configs without Proxy unless NO_PROXY names a CIDR.
// With such a CIDR they use a closure of utilnet.NewProxierWithNoProxyCIDR,
// whose code is also that of a config's own Proxy built with it around
// another function: such a proxy function is asked per request.
func routesByEnvironment(proxy func(*http.Request) (*url.URL, error)) bool {
	return proxy != nil && reflect.ValueOf(proxy).Pointer() == reflect.ValueOf(http.ProxyFromEnvironment).Pointer()
}

// isClientGoTransportFor reports whether got is the transport client-go's cache
// holds for id's certificate files: the proof that got reads the same files,
// which no comparison of what it presents can give (a copy naming other files
// with the same bytes presents the same certificate until the files diverge).
func isClientGoTransportFor(got *http.Transport, id *identity) bool {
	if id.clientGoKey == nil || !isEnvProxier(got.Proxy) {
		// Only a transport client-go built for a config without Proxy can
		// be in its cache; asking the cache about another would build the
		// identity's transport, and its certificate refresher, for nothing.
		return false
	}
	key := *id.clientGoKey // client-go fills in what it reads from the files
	key.NextProtos = slices.Clone(key.NextProtos)
	rt, err := transport.New(&transport.Config{TLS: key, DisableCompression: id.disableCompression})
	return err == nil && clientGoTransport(rt) == got
}

// dialFingerprint tells which dialer a transport dials with, so the hook can
// show that client-go's transport for a client dials as the shared one does.
// Dial functions cannot be compared in Go; their closures can. A func value
// points to a closure record whose first word is the code pointer and whose
// next words are what it captured (for a method value, the receiver). Two
// copies of one func value point to one record. client-go's default dialer is
// a fresh (&net.Dialer{...}).DialContext per transport, recognised by its code
// pointer and its receiver's settings, and client-go wraps dialers in
// connrotation.Dialer (certificate files, exec plugins), which dials through
// the dialer it wraps: the fingerprint looks through it. Anything this cannot
// read is unknown, and unknown never matches.
type dialFingerprint struct {
	kind    dialKind
	closure unsafe.Pointer // kind dialFunc: the closure record, kept alive so its address is not reused
}

type dialKind uint8

const (
	dialUnknown dialKind = iota
	dialDefault          // client-go's default dialer
	dialFunc             // one particular func value
)

var defaultDial = dialFingerprint{kind: dialDefault}

func (f dialFingerprint) known() bool { return f.kind != dialUnknown }

type dialFn = func(ctx context.Context, network, address string) (net.Conn, error)

// closureOf returns the closure record of a func value.
func closureOf(f dialFn) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&f)) }

// receiverOf returns the receiver a method value captured. The caller checks
// the code pointer first.
func receiverOf[R any](f dialFn) *R {
	return *(**R)(unsafe.Add(closureOf(f), unsafe.Sizeof(uintptr(0))))
}

var (
	netDialerCode = reflect.ValueOf((&net.Dialer{}).DialContext).Pointer()
	rotDialerCode = reflect.ValueOf(connrotation.NewDialer(nil).DialContext).Pointer()
)

// dialInspection reports whether closures look as fingerprintDial expects on
// this toolchain; if not, every dialer is unknown and configs whose dialer
// must be shown pass through.
var dialInspection = sync.OnceValue(func() bool {
	d := &net.Dialer{Timeout: time.Second}
	inner := d.DialContext
	rd := connrotation.NewDialer(inner)
	outer := rd.DialContext
	if reflect.ValueOf(inner).Pointer() != netDialerCode || receiverOf[net.Dialer](inner) != d ||
		reflect.ValueOf(outer).Pointer() != rotDialerCode || receiverOf[connrotation.Dialer](outer) != rd {
		return false
	}
	got, ok := wrappedDial(rd)
	return ok && closureOf(got) == closureOf(inner)
})

// wrappedDial reads the dialer a connrotation.Dialer dials through.
func wrappedDial(rd *connrotation.Dialer) (dialFn, bool) {
	f := reflect.ValueOf(rd).Elem().FieldByName("dial")
	if !f.IsValid() || f.Type() != reflect.TypeFor[connrotation.DialFunc]() {
		return nil, false
	}
	return *(*dialFn)(unsafe.Pointer(f.UnsafeAddr())), true
}

// execTracker returns the connection tracker of a connrotation dialer (the one
// client-go's exec authenticator closes when the plugin's certificate
// changes), or nil.
func execTracker(f dialFn) *connrotation.ConnectionTracker {
	if f == nil || !dialInspection() || reflect.ValueOf(f).Pointer() != rotDialerCode {
		return nil
	}
	return receiverOf[connrotation.Dialer](f).ConnectionTracker
}

func fingerprintDial(f dialFn) dialFingerprint {
	if f == nil || !dialInspection() {
		return dialFingerprint{}
	}
	for range 4 {
		code := reflect.ValueOf(f).Pointer()
		switch {
		case code == rotDialerCode:
			inner, ok := wrappedDial(receiverOf[connrotation.Dialer](f))
			if !ok || inner == nil {
				return dialFingerprint{}
			}
			f = inner
			continue
		case code == netDialerCode && isClientGoDialer(receiverOf[net.Dialer](f)):
			return defaultDial
		}
		return dialFingerprint{kind: dialFunc, closure: closureOf(f)}
	}
	return dialFingerprint{}
}

// isClientGoDialer reports whether d is set as client-go sets its default
// dialer: 30 s timeout and keep-alive, everything else zero.
func isClientGoDialer(d *net.Dialer) bool {
	if d == nil || d.Timeout != 30*time.Second || d.KeepAlive != 30*time.Second {
		return false
	}
	v := reflect.ValueOf(d).Elem()
	for i := range v.NumField() {
		switch v.Type().Field(i).Name {
		case "Timeout", "KeepAlive":
		default:
			if !v.Field(i).IsZero() {
				return false
			}
		}
	}
	return true
}
