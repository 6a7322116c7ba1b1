// Redaction: every URL or host the pool prints (log lines, errors, Stats,
// Identities, metric labels) goes through redactHost, which parses it as
// client-go does and prints only what a connection goes to; text it cannot
// parse is never printed.

package sharedtransport

import (
	"errors"
	"net"
	"net/url"
	"strings"
)

// unparsableURL stands for a URL or host that does not parse: its text may
// hold a password in any shape, so none of it is printed.
const unparsableURL = "<a URL that does not parse>"

// redactHost returns host (a config's Host, a proxy URL) as
// rest.DefaultServerURL reads it, a host:port without a scheme included,
// reduced to its scheme and host: user info is the credential (a password,
// or a token as user name), and client-go sends no path a Host may hold.
// Printing the parsed parts only, never the text around them, keeps a
// password with any bytes in it ("/", "@", quotes, spaces) out of the output.
func redactHost(host string) string {
	if host == "" {
		return ""
	}
	u, err := url.Parse(host)
	if err != nil || u.Scheme == "" || u.Host == "" {
		// client-go's reading of a Host without a scheme, which it refuses
		// when a path follows.
		if u, err = url.Parse("https://" + host); err != nil || u.Host == "" || u.Path != "" && u.Path != "/" {
			return unparsableURL
		}
	}
	if !plainHost(u) {
		return unparsableURL
	}
	return (&url.URL{Scheme: u.Scheme, Host: u.Host}).String()
}

// plainHost reports whether u's host is an IP or a DNS name and its port
// digits: a malformed URL can leave user info in the host ("http://u:pw:#@h"
// parses as host "u:pw:"), which is then not printed either.
func plainHost(u *url.URL) bool {
	name, port := u.Hostname(), u.Port()
	if strings.Trim(port, "0123456789") != "" || name == "" {
		return false
	}
	if net.ParseIP(name) != nil {
		return true
	}
	return strings.Trim(strings.ToLower(name), "abcdefghijklmnopqrstuvwxyz0123456789-._") == ""
}

// redactError describes err, the error of a config's Proxy function, which
// may quote the URL it failed on anywhere in its text: a *url.Error is
// printed with its URL redacted, anything else by a fixed description.
func redactError(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Op + " " + redactHost(ue.URL) + ": " + redactError(ue.Err)
	}
	if err == nil {
		return "no error"
	}
	return "an error whose text is not shown (it may quote a URL with its password)"
}
