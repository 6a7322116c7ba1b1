// Package fakeopenstack serves as much of Keystone v3 and Nova as Cluster
// API Provider OpenStack's scopes and compute client use, over TLS on
// loopback, and counts on the server side: connections accepted and open,
// full and resumed handshakes, and every request's X-Auth-Token against the
// credential that was issued it.
package fakeopenstack

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// Region is the one region of the catalog.
const Region = "RegionOne"

// Options configure a Server.
type Options struct {
	HTTP1Only     bool          // no HTTP/2 (ALPN offers http/1.1 only)
	TokenLifetime time.Duration // how long a token is valid (default 1 hour)
	// Users are the credentials Keystone accepts: user name to password.
	// Each user's project is named and numbered after it.
	Users map[string]string
	// Host is the name in the server's URL, catalog and certificate
	// (default 127.0.0.1); it listens on 127.0.0.1 whatever the name. A
	// name nobody resolves is reached through a Proxy that knows it.
	Host string
}

// Counts are what the server saw.
type Counts struct {
	Accepted, Open, FullHandshakes, Resumed int64
	Tokens                                  int64 // tokens issued
	Requests                                int64 // Nova requests with a valid token
	WrongTokens                             int64 // requests whose token was unknown or expired
}

// Server is a fake Keystone and Nova behind one testserver listener: its
// TLS, and its connections counted as the API server's are.
type Server struct {
	URL string // Keystone is URL+"/v3"; Nova URL+"/compute/v2.1"
	CA  []byte // PEM of the CA that issued the server's certificate

	opts Options
	srv  *testserver.Server

	tokens, requests, wrong atomic.Int64

	mu     sync.Mutex
	issued map[string]issued // token -> whom, until when
	order  []string          // the tokens, in the order issued
}

type issued struct {
	user    string
	expires time.Time
}

// Start starts a server; Close stops it.
func Start(opts Options) (*Server, error) {
	if opts.TokenLifetime == 0 {
		opts.TokenLifetime = time.Hour
	}
	s := &Server{opts: opts, issued: map[string]issued{}}
	ca, err := testserver.NewCA("fakeopenstack-ca")
	if err != nil {
		return nil, err
	}
	var names []string
	if opts.Host != "" {
		names = append(names, opts.Host)
	}
	serving, err := ca.IssueServer(names...)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v3/auth/tokens", s.issue)
	mux.HandleFunc("GET /v3/auth/tokens", s.validate)
	mux.HandleFunc("GET /compute/v2.1", s.novaVersion)
	mux.HandleFunc("GET /compute/v2.1/", s.novaVersion)
	mux.HandleFunc("GET /compute/v2.1/servers/detail", s.servers)
	srv, err := testserver.Start(testserver.Options{
		CA:           ca,
		ServerCert:   serving,
		Handler:      mux,
		DisableHTTP2: opts.HTTP1Only,
		ClientAuth:   testserver.VerifyClientCertIfGiven, // clients authenticate with tokens
	})
	if err != nil {
		return nil, err
	}
	s.srv, s.URL, s.CA = srv, srv.URL(), ca.CertPEM()
	if opts.Host != "" {
		_, port, _ := net.SplitHostPort(srv.Addr())
		s.URL = "https://" + net.JoinHostPort(opts.Host, port)
	}
	return s, nil
}

// Close stops the server and closes every connection.
func (s *Server) Close() { s.srv.Close() }

// CloseClientConnections closes every connection, as a restart would.
func (s *Server) CloseClientConnections() { s.srv.CloseClientConnections() }

// Counts returns what the server saw so far.
func (s *Server) Counts() Counts {
	st := s.srv.Stats()
	return Counts{
		Accepted: int64(st.Accepted), Open: int64(st.Open),
		FullHandshakes: int64(st.FullHandshakes), Resumed: int64(st.ResumedHandshakes),
		Tokens: s.tokens.Load(), Requests: s.requests.Load(), WrongTokens: s.wrong.Load(),
	}
}

// Tokens returns every token issued so far, for tests that look for them
// where they must not be.
func (s *Server) Tokens() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.order)
}

// holderOrRefuse returns whom r's X-Auth-Token was issued to, or answers
// 401 and counts a wrong token.
func (s *Server) holderOrRefuse(w http.ResponseWriter, r *http.Request) (issued, bool) {
	who, ok := s.holder(r.Header.Get("X-Auth-Token"))
	if !ok {
		s.wrong.Add(1)
		http.Error(w, `{"error": {"code": 401, "message": "invalid token"}}`, http.StatusUnauthorized)
	}
	return who, ok
}

// issue is Keystone's password authentication, scoped to the user's project.
func (s *Server) issue(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Auth struct {
			Identity struct {
				Password struct {
					User struct {
						Name     string `json:"name"`
						Password string `json:"password"`
					} `json:"user"`
				} `json:"password"`
			} `json:"identity"`
		} `json:"auth"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, `{"error": {"code": 400, "message": "malformed request"}}`, http.StatusBadRequest)
		return
	}
	u := req.Auth.Identity.Password.User
	if want, ok := s.opts.Users[u.Name]; !ok || want != u.Password {
		http.Error(w, `{"error": {"code": 401, "message": "The request you have made requires authentication."}}`, http.StatusUnauthorized)
		return
	}
	b := make([]byte, 16)
	rand.Read(b)
	token := hex.EncodeToString(b)
	expires := time.Now().Add(s.opts.TokenLifetime).UTC()
	s.mu.Lock()
	s.issued[token] = issued{user: u.Name, expires: expires}
	s.order = append(s.order, token)
	s.mu.Unlock()
	s.tokens.Add(1)
	w.Header().Set("X-Subject-Token", token)
	s.writeToken(w, http.StatusCreated, u.Name, expires)
}

// validate is Keystone's token validation (GET with X-Subject-Token).
func (s *Server) validate(w http.ResponseWriter, r *http.Request) {
	who, ok := s.holderOrRefuse(w, r)
	if !ok {
		return
	}
	subject, ok := s.holder(r.Header.Get("X-Subject-Token"))
	if !ok || subject.user != who.user {
		http.Error(w, `{"error": {"code": 404, "message": "token not found"}}`, http.StatusNotFound)
		return
	}
	s.writeToken(w, http.StatusOK, subject.user, subject.expires)
}

func (s *Server) writeToken(w http.ResponseWriter, status int, user string, expires time.Time) {
	endpoint := func(url string) []map[string]string {
		var eps []map[string]string
		for _, iface := range []string{"public", "internal", "admin"} {
			eps = append(eps, map[string]string{"id": iface, "interface": iface, "region": Region, "region_id": Region, "url": url})
		}
		return eps
	}
	body := map[string]any{"token": map[string]any{
		"methods":    []string{"password"},
		"expires_at": expires.Format("2006-01-02T15:04:05.000000Z"),
		"issued_at":  time.Now().UTC().Format("2006-01-02T15:04:05.000000Z"),
		"user":       map[string]any{"id": "user-" + user, "name": user, "domain": map[string]string{"id": "default", "name": "Default"}},
		"project":    map[string]any{"id": projectID(user), "name": "project-" + user, "domain": map[string]string{"id": "default", "name": "Default"}},
		"catalog": []map[string]any{
			{"type": "identity", "name": "keystone", "id": "identity", "endpoints": endpoint(s.URL + "/v3")},
			{"type": "compute", "name": "nova", "id": "compute", "endpoints": endpoint(s.URL + "/compute/v2.1")},
		},
	}}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(body)
}

// projectID is the id of user's project.
func projectID(user string) string { return "project-id-" + user }

// holder returns whom token was issued to, if it is valid now.
func (s *Server) holder(token string) (issued, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	who, ok := s.issued[token]
	return who, ok && time.Now().Before(who.expires)
}

// novaVersion is Nova's version document, which the compute client reads
// for the microversions the server supports.
func (s *Server) novaVersion(w http.ResponseWriter, r *http.Request) {
	if _, ok := s.holderOrRefuse(w, r); !ok {
		return
	}
	s.requests.Add(1)
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"version": map[string]string{
		"id": "v2.1", "status": "CURRENT", "version": "2.96", "min_version": "2.1",
	}})
}

// servers lists the servers of the token's project: one, named after its
// user, so a client sees whose token the server took.
func (s *Server) servers(w http.ResponseWriter, r *http.Request) {
	who, ok := s.holderOrRefuse(w, r)
	if !ok {
		return
	}
	s.requests.Add(1)
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"servers": []map[string]any{{
		"id": "server-" + who.user, "name": "server-of-" + who.user, "status": "ACTIVE", "tenant_id": projectID(who.user),
	}}})
}
