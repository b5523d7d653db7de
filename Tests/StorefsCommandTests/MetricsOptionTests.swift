import Testing
import StorefsCore
@testable import storefs

/// `metrics=` on the command line (docs/operations.md, "Metrics"; docs/security.md).
@Suite struct MetricsOptionTests {
    @Test func metricsOptionIsLoopbackUnlessBindAnyIsGiven() throws {
        guard case .mount(let o) = try MountOptions.parse(arguments: ["-o", "metrics=9464,log_format=json,log_file=/l", "b", "/m"], environment: [:]) else {
            Issue.record("not a mount")
            return
        }
        #expect(o.metrics == .tcp(host: "127.0.0.1", port: 9464) && o.logFormat == .json && o.logFile == "/l")
        #expect(throws: MountOptions.ParseError.self) {
            try MountOptions.parse(arguments: ["-o", "metrics=0.0.0.0:9464", "b", "/m"], environment: [:])
        }
        guard case .mount(let any) = try MountOptions.parse(arguments: ["-o", "metrics=0.0.0.0:9464,metrics_bind_any", "b", "/m"], environment: [:]) else {
            Issue.record("not a mount")
            return
        }
        #expect(any.metrics == .tcp(host: "0.0.0.0", port: 9464) && any.metricsBindAny)
        guard case .mount(let unix) = try MountOptions.parse(arguments: ["-o", "metrics=unix:/run/s.sock", "b", "/m"], environment: [:]) else {
            Issue.record("not a mount")
            return
        }
        #expect(unix.metrics == .unix(path: "/run/s.sock"))
        #expect(throws: MountOptions.ParseError.self) {
            try MountOptions.parse(arguments: ["-o", "metrics=unix:relative.sock", "b", "/m"], environment: [:])
        }
        #expect(throws: MountOptions.ParseError.self) {
            try MountOptions.parse(arguments: ["-o", "metrics=127.0.0.1:70000", "b", "/m"], environment: [:])
        }
        #expect(try MountOptions.parse(arguments: ["prefetch", "-j", "2", "/m"], environment: [:]) == .prefetch(["-j", "2", "/m"]))
        #expect(try MountOptions.parse(arguments: ["cache", "status"], environment: [:]) == .cache(["status"]))
    }
}
