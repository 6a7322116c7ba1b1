package memberproxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"
)

// Client is a caller of a Front served on loopback: what the tests send
// through the aggregated API server to its members.
type Client struct {
	URL  string
	HTTP *http.Client

	srv *httptest.Server
	tr  *http.Transport
}

// Serve serves f on 127.0.0.1 and returns a client for it. Close stops both.
func Serve(f *Front) *Client {
	srv := httptest.NewServer(f)
	tr := &http.Transport{MaxIdleConnsPerHost: 200}
	return &Client{URL: srv.URL, HTTP: &http.Client{Transport: tr, Timeout: 30 * time.Second}, srv: srv, tr: tr}
}

// Close closes the client's connections and stops the front's server.
func (c *Client) Close() {
	c.tr.CloseIdleConnections()
	c.srv.Close()
}

// ClusterURL is the front's URL of path on cluster.
func (c *Client) ClusterURL(cluster, path string) string {
	return c.URL + PathPrefix + cluster + "/proxy" + path
}

// CallerAuthorization is the Authorization header a caller sends the front
// with; it must never reach the member.
const CallerAuthorization = "Bearer caller-token-for-the-front"

// Get sends GET path to cluster through the front.
func (c *Client) Get(ctx context.Context, cluster, path, userAgent string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.ClusterURL(cluster, path), nil)
	if err != nil {
		return 0, nil, err
	}
	if userAgent != "" {
		req.Header.Set("User-Agent", userAgent)
	}
	req.Header.Set("Authorization", CallerAuthorization)
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

// ListNodes lists nodes on cluster through the front and fails on anything
// but a NodeList.
func (c *Client) ListNodes(ctx context.Context, cluster, userAgent string) error {
	code, body, err := c.Get(ctx, cluster, "/api/v1/nodes", userAgent)
	if err != nil {
		return fmt.Errorf("%s: %w", cluster, err)
	}
	if code != http.StatusOK || !strings.Contains(string(body), `"NodeList"`) {
		return fmt.Errorf("%s: %d %s", cluster, code, body)
	}
	return nil
}
