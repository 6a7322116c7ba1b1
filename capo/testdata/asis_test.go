//go:build !capo_patched

package scope_test

// patched says which CAPO the tests run against: as is.
const patched = false
