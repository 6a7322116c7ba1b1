//go:build capo_patched

package scope_test

// patched says which CAPO the tests run against: with capo/patches.
const patched = true
