package scope_test

import (
	"os"
	"testing"

	"github.com/sharedtransport/sharedtransport/capo/fakeopenstack"
)

// TestMain serves fakeopenstack.StartProcess's child when this test binary
// is started as one (TestSharedScopeLoad's servers), and runs the tests
// otherwise.
func TestMain(m *testing.M) {
	if code, isChild := fakeopenstack.Main(); isChild {
		os.Exit(code)
	}
	os.Exit(m.Run())
}
