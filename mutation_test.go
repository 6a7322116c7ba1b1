//go:build mutation

package sharedtransport

// The security- and connection-critical tests, which run in seconds: identity
// keys, copy safety, the hook, requests that wait on no dial of another's, rotation's
// hand-over of connections and the files it watches, and the redaction of
// secrets. hack/mutation.sh runs them for each mutant.
func init() {
	focusedTests = `^(TestIsolation|TestIdentities|TestIdentityProperty|TestCopySafety|TestCopyCrossings|TestCopyProperty|` +
		`TestAdversary.*|TestProxyConnectHeader|TestWrapPassesFunctionsThrough|TestAboveTheHookDecorators|TestHookComposition|TestClients|` +
		`TestColdStartBurst|TestSeedLoadBesideWatch|TestWedgedFirstConnection|TestWedgedConnectionBesideFullOne|` +
		`TestResetFirstConnectionBesideWatches|TestProtocolChangeWhileDraining|TestSlowTunnelsOneStream|TestStalledPostBody|` +
		`TestHTTP1Burst|TestHTTP1OnlyOneConnection|` +
		`TestCloseIdleConnectionsFor|TestRetiredGenerationRetried|TestRotationClosesOldConnsWhenIdle|` +
		`TestRotationClosesIdleAtOnce|TestKeepAliveOff|TestRotationHalfFromFiles|TestRotationPresentsNewCertificateAtOnce|` +
		`TestLifetime|TestSessionResumption|TestUpgrades|TestFullConnectionGrows|TestDueSoonBesideFullConnection|TestFailuresFailTogether|TestProtocolSwitch|TestHostPasswordRedacted|TestSecretsStaySecret|TestIdentityNamesResistGuessing)$`
}
