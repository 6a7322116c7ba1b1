package sharedtransport

import "testing"

// TestExecCertRotationResumption: with the default options (session
// resumption on), the connection after an exec plugin's certificate changed
// must authenticate with the new certificate, not resume a session of the
// old one.
func TestExecCertRotationResumption(t *testing.T) {
	checkExecRotation(t)
}
