import Testing
@testable import StorefsCore

@Suite struct LogTests {
    /// Object names reach log lines: a newline or an escape sequence in one must not forge a
    /// line or drive the terminal of whoever reads the log.
    @Test(arguments: [
        ("plain name.txt", "plain name.txt"),
        ("evil\nstorefs[info] mounted", "evil\\x0astorefs[info] mounted"),
        ("\u{1b}[31mred", "\\x1b[31mred"),
        ("cr\rtab\tdel\u{7f}c1\u{85}", "cr\\x0dtab\\x09del\\x7fc1\\x85"),
        ("back\\slash", "back\\\\slash"),
        ("ünïcødé 日本", "ünïcødé 日本"),
    ])
    func controlCharactersAreEscaped(raw: String, shown: String) {
        #expect(Log.escaped(raw) == shown)
    }
}
