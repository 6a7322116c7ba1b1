// Package spdyecho is a member API server that speaks SPDY as a kubelet's
// exec does, and the client side of such an exec, for the tests of upgrades
// through internal/memberproxy's front. It is a package of its own so that
// what imports internal/testserver does not need SPDY.
package spdyecho

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/apimachinery/pkg/util/httpstream/spdy"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// Member is a member API server that answers plain requests with the user
// it saw and upgrades SPDY requests (kubectl exec, attach, port-forward) to
// an echo: every stream it is given says hello and then echoes what it
// reads. It counts the connections it accepts. (testserver.Server's upgrades
// echo raw bytes instead.)
type Member struct {
	URL string
	CA  *testserver.CA

	accepted, open atomic.Int64

	mu       sync.Mutex // guards upgrades
	upgrades []string   // "user proto" of every upgrade request

	srv      *http.Server
	done     chan struct{}
	served   chan struct{}
	handlers sync.WaitGroup
}

// Start starts a Member on 127.0.0.1 that authenticates client
// certificates of its CA (the user is the common name) and the bearer
// tokens of tokens (token to user).
func Start(tokens map[string]string) (*Member, error) {
	ca, err := testserver.NewCA("echo-member-ca")
	if err != nil {
		return nil, err
	}
	serving, err := ca.IssueServer()
	if err != nil {
		return nil, err
	}
	cert, err := serving.TLSCertificate()
	if err != nil {
		return nil, err
	}
	m := &Member{CA: ca, done: make(chan struct{}), served: make(chan struct{})}
	m.srv = &http.Server{
		Handler: m.handler(tokens),
		TLSConfig: &tls.Config{
			Certificates: []tls.Certificate{cert},
			ClientCAs:    ca.Pool(),
			ClientAuth:   tls.VerifyClientCertIfGiven,
		},
		ConnState: func(_ net.Conn, st http.ConnState) {
			switch st {
			case http.StateNew:
				m.accepted.Add(1)
				m.open.Add(1)
			case http.StateClosed, http.StateHijacked:
				m.open.Add(-1)
			}
		},
		ErrorLog: log.New(io.Discard, "", 0),
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	m.URL = "https://" + ln.Addr().String()
	go func() { defer close(m.served); _ = m.srv.ServeTLS(ln, "", "") }()
	return m, nil
}

func (m *Member) handler(tokens map[string]string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme, token, _ := strings.Cut(r.Header.Get("Authorization"), " ")
		user := ""
		if strings.EqualFold(scheme, "bearer") { // Karmada's proxy writes "bearer"
			user = tokens[token]
		}
		if len(r.TLS.PeerCertificates) > 0 {
			user = r.TLS.PeerCertificates[0].Subject.CommonName
		}
		if user == "" {
			http.Error(w, "Unauthorized", http.StatusUnauthorized)
			return
		}
		if !httpstream.IsUpgradeRequest(r) {
			fmt.Fprintf(w, "hello %s", user)
			return
		}
		m.mu.Lock()
		m.upgrades = append(m.upgrades, user+" "+r.Proto)
		m.mu.Unlock()
		m.handlers.Add(1)
		defer m.handlers.Done()
		// Like a process that exits when its stdin ends: the member closes
		// the connection once the stream is echoed. (Closing first also
		// keeps spdystream from parking its shutdown goroutine for 10
		// minutes, which it does when the peer closed the connection first.)
		echoed := make(chan struct{}, 1)
		conn := spdy.NewResponseUpgrader().UpgradeResponse(w, r, func(s httpstream.Stream, replySent <-chan struct{}) error {
			go func() {
				<-replySent
				_, _ = fmt.Fprintf(s, "hello %s\n", user)
				_, _ = io.Copy(s, s)
				s.Close()
				echoed <- struct{}{}
			}()
			return nil
		})
		if conn == nil {
			return
		}
		defer conn.Close()
		select {
		case <-echoed:
		case <-conn.CloseChan():
		case <-m.done:
		}
	})
}

// Accepted is the number of connections accepted.
func (m *Member) Accepted() int64 { return m.accepted.Load() }

// Open is the number of connections open now.
func (m *Member) Open() int64 { return m.open.Load() }

// LastUpgrade is the "user proto" of the last upgrade request, "" if none.
func (m *Member) LastUpgrade() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.upgrades) == 0 {
		return ""
	}
	return m.upgrades[len(m.upgrades)-1]
}

// Close ends the upgrades still running, stops the server and waits for
// its handlers.
func (m *Member) Close() {
	close(m.done)
	m.srv.Close()
	<-m.served
	m.handlers.Wait()
}

// Exec opens a SPDY connection to url (an exec path) with the Authorization
// header authorization, as kubectl exec does, and returns what the member
// said on a stream it was sent payload on.
func Exec(ctx context.Context, url, authorization, payload string) (string, error) {
	rt, err := spdy.NewRoundTripperWithConfig(spdy.RoundTripperConfig{})
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, nil)
	if err != nil {
		return "", err
	}
	req.Header.Set(httpstream.HeaderProtocolVersion, "v4.channel.k8s.io")
	req.Header.Set("Authorization", authorization)
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return "", err
	}
	conn, err := rt.NewConnection(resp)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	stream, err := conn.CreateStream(http.Header{"streamType": {"stdin"}})
	if err != nil {
		return "", err
	}
	if _, err := io.WriteString(stream, payload); err != nil {
		return "", err
	}
	if err := stream.Close(); err != nil { // the end of stdin
		return "", err
	}
	got, err := io.ReadAll(stream)
	if err != nil {
		return "", err
	}
	select { // the member closes the connection when it is done
	case <-conn.CloseChan():
	case <-ctx.Done():
		return "", ctx.Err()
	}
	return string(got), nil
}
