package testserver

import (
	"fmt"
	"maps"
	"slices"
	"sync"
)

// AfterRotation is the User-Agent of requests a test sends after it
// rotated a RotationMember's credentials.
const AfterRotation = "sent-after-rotation"

// RotationMember is a member API server that accepts the front's old and
// new credentials (client certificates V1 and V2, for front-v1 and
// front-v2, and tokens token-v1 and token-v2) and checks that requests
// marked AfterRotation use the new ones.
type RotationMember struct {
	*Server
	V1, V2 *KeyPair

	mu         sync.Mutex // guards the fields below
	users      map[string]int
	after      int      // requests sent after the rotation
	violations []string // requests sent after the rotation with old credentials
}

// StartRotationMember starts a RotationMember on 127.0.0.1.
func StartRotationMember() (*RotationMember, error) {
	ca, err := NewCA("rotation-member-ca")
	if err != nil {
		return nil, err
	}
	m := &RotationMember{users: map[string]int{}}
	if m.V1, err = ca.IssueClient("front-v1"); err != nil {
		return nil, err
	}
	if m.V2, err = ca.IssueClient("front-v2"); err != nil {
		return nil, err
	}
	m.Server, err = Start(Options{
		CA:         ca,
		ClientAuth: VerifyClientCertIfGiven,
		Tokens:     map[string]string{"token-v1": "front-v1", "token-v2": "front-v2"},
		OnRequest:  m.record,
	})
	return m, err
}

func (m *RotationMember) record(ri RequestInfo) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.users[ri.User]++
	if ri.UserAgent == AfterRotation {
		m.after++
		if ri.User != "front-v2" {
			m.violations = append(m.violations, fmt.Sprintf("cert %q token %q", ri.CertCN, ri.Token))
		}
	}
}

// Seen returns the requests per user, how many were marked AfterRotation,
// and the marked ones that came with old credentials.
func (m *RotationMember) Seen() (users map[string]int, after int, violations []string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.users), m.after, slices.Clone(m.violations)
}
