package conns

import (
	"crypto/tls"
	"net/http"
	"testing"
)

// BenchmarkRoundTripNoopBase: what the connection layer adds per request,
// over an http.Transport that hands every https request to a round tripper
// that does nothing ("Transports"), beside that base alone
// ("http.Transport").
func BenchmarkRoundTripNoopBase(b *testing.B) {
	req, err := http.NewRequest(http.MethodGet, "https://h.example/version", nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("http.Transport", func(b *testing.B) {
		rt := noopTransport()
		b.ReportAllocs()
		for b.Loop() {
			if _, err := rt.RoundTrip(req); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("Transports", func(b *testing.B) {
		t := NewTransports(Config{TLS: &tls.Config{}, KeepAlive: true}, nil)
		defer t.Close(nil)
		t.shared = noopTransport()
		b.ReportAllocs()
		for b.Loop() {
			if _, err := t.RoundTrip(req, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
}

type noopRT struct{}

// noopTransport is an http.Transport that hands every https request to
// noopRT, as it hands requests to its HTTP/2 connections.
func noopTransport() *http.Transport {
	t := &http.Transport{}
	t.RegisterProtocol("https", noopRT{})
	return t
}

var noopResponse = &http.Response{StatusCode: http.StatusOK, ProtoMajor: 2, Body: http.NoBody}

func (noopRT) RoundTrip(*http.Request) (*http.Response, error) { return noopResponse, nil }
