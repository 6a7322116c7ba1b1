package sharedtransport

import (
	"flag"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/sharedtransport/sharedtransport/internal/childproc"
	"github.com/sharedtransport/sharedtransport/internal/testserver"
)

// focusedTests, set under the mutation build tag (mutation_test.go), is the
// test set each mutant of a mutation run is tried against.
var focusedTests string

func TestMain(m *testing.M) {
	// Run as startMemberProcess's child, this binary serves the member
	// server and runs no test.
	if code, isChild := childproc.Main(memberProcessEnv, map[string]childproc.Starter{"member": testserver.ServeProcess}); isChild {
		os.Exit(code)
	}
	if focusedTests != "" {
		// The mutation tester runs plain go test: the set and -short
		// are chosen here.
		if err := flag.Set("test.run", focusedTests); err != nil {
			panic(err)
		}
		if err := flag.Set("test.short", "true"); err != nil {
			panic(err)
		}
	}
	goleak.VerifyTestMain(m,
		// klog's flush daemon, started by client-go's import of klog.
		goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"),
		// Before v0.36 client-go starts a certificate-file refresher for
		// every transport it cannot cache (a config with Proxy and cert
		// files) and never stops it. The hook runs after client-go built
		// that transport, so the pool cannot prevent it.
		goleak.IgnoreAnyFunction("k8s.io/client-go/transport.(*dynamicClientCert).Run"),
		// From v0.36 client-go stops it when its transport is garbage
		// collected; the last few may still run when the tests end.
		goleak.IgnoreAnyFunction("k8s.io/client-go/transport.(*dynamicClientCert).run"),
		goleak.IgnoreAnyFunction("k8s.io/client-go/transport.(*dynamicClientCert).processNextWorkItem"),
		goleak.IgnoreAnyFunction("k8s.io/apimachinery/pkg/util/wait.PollImmediateUntilWithContext.poller.func1.1"),
		goleak.IgnoreAnyFunction("k8s.io/apimachinery/pkg/util/wait.PollImmediateUntil"),
		// The same poller as Go 1.27 names it.
		goleak.IgnoreAnyFunction("k8s.io/apimachinery/pkg/util/wait.poller.func1.1"),
		goleak.IgnoreAnyFunction("k8s.io/client-go/util/workqueue.(*delayingType[...]).waitingLoop"),
	)
}
