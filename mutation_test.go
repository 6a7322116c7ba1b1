//go:build mutation

package sharedtransport

// The security- and connection-critical tests, which run in seconds: identity
// keys, copy safety, the hook, the connection gate and cap, rotation's
// hand-over of connections and the files it watches, and the redaction of
// secrets. hack/mutation.sh runs them for each mutant.
func init() {
	focusedTests = `^(TestIsolation|TestIdentities|TestIdentityProperty|TestCopySafety|TestCopyCrossings|TestCopyProperty|` +
		`TestAdversary.*|TestProxyConnectHeader|TestWrapPassesFunctionsThrough|TestAboveTheHookDecorators|TestHookComposition|TestClients|` +
		`TestColdStartBurst|TestConnectionCap|TestConnectionCapPerHost|TestGateWaitsForConnection|` +
		`TestFailedFirstRequestHandsLead|TestProtocolPerHost|TestSlotReleasedAtEOF|TestHTTP1OnlyOneConnection|` +
		`TestCloseIdleConnectionsFor|TestRetiredGenerationRetried|TestRotationClosesOldConnsWhenIdle|` +
		`TestRotationClosesIdleAtOnce|TestKeepAliveOff|TestRotationHalfFromFiles|TestRotationPresentsNewCertificateAtOnce|` +
		`TestLifetime|TestSessionResumption|TestUpgrades|TestFullConnectionGrows|TestConnectionCapFewerStreams|TestConnectionCapHTTP1|TestProtocolSwitch|TestConnectionCapAfterClose|TestHostPasswordRedacted|TestSecretsStaySecret|TestIdentityNamesResistGuessing)$`
}
