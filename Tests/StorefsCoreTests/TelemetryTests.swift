import Foundation
import Testing
import Synchronization
import StorageClient
@testable import StorefsCore

@Suite struct TelemetryTests {
    @Test func textLinesAreLogfmtAndQuoteOnlyWhatNeedsIt() {
        let line = LogLine.text(time: "2026-11-30T23:59:01.123Z", level: "warn", message: "read failed",
                                fields: [("object", "a b/\"c\".bin"), ("offset", "0"), ("empty", ""), ("evil", "x\ny=1")])
        #expect(line == #"ts=2026-11-30T23:59:01.123Z level=warn msg="read failed" object="a b/\"c\".bin" offset=0 empty="" evil="x\x0ay=1""#)
    }

    @Test func jsonLinesParseAndKeepNumbersNumeric() throws {
        let line = LogLine.json(time: "2026-11-30T23:59:01.123Z", level: "debug", message: "http",
                                fields: [("status", "206"), ("dur_ms", "1.250"), ("name", "ü\u{1}\n\"x\""), ("gen", "0123"), ("neg", "-5")])
        let obj = try #require(try JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any])
        #expect(obj["ts"] as? String == "2026-11-30T23:59:01.123Z" && obj["level"] as? String == "debug")
        #expect((obj["status"] as? NSNumber)?.intValue == 206 && (obj["dur_ms"] as? NSNumber)?.doubleValue == 1.25)
        #expect(obj["name"] as? String == "ü\u{1}\n\"x\"")
        #expect(obj["gen"] as? String == "0123", "a leading zero is not a JSON number: kept as text")
        #expect((obj["neg"] as? NSNumber)?.intValue == -5)
        #expect(!line.contains("\n"))
    }

    @Test func timestampsAreRFC3339UTCWithMilliseconds() {
        let ts = LogLine.timestamp()
        #expect(ts.count == 24 && ts.hasSuffix("Z") && ts.dropFirst(10).first == "T" && ts.dropFirst(19).first == ".")
    }

    @Test func histogramBucketsAndPrometheusTextAreCumulative() {
        var h = Histogram()
        for s in [0.00005, 0.003, 0.003, 7.0, 30.0] { h.observe(s) }
        #expect(h.count == 5 && h.counts[0] == 1 && h.counts.last == 1)
        var m = Metrics.Snapshot()
        m.readLatency = h
        m.requests = [.media: [206: 3, 0: 1]]
        m.opNames = ["lookup", "read"]
        m.ops = [0, 5]
        m.errors = [5: 2]
        let text = PrometheusText.render(m, Gauges())
        #expect(text.contains("storefs_fuse_read_duration_seconds_bucket{le=\"0.0001\"} 1\n"))
        #expect(text.contains("storefs_fuse_read_duration_seconds_bucket{le=\"0.005\"} 3\n"))
        #expect(text.contains("storefs_fuse_read_duration_seconds_bucket{le=\"10\"} 4\n"))
        #expect(text.contains("storefs_fuse_read_duration_seconds_bucket{le=\"+Inf\"} 5\n"))
        #expect(text.contains("storefs_fuse_read_duration_seconds_count 5\n"))
        #expect(text.contains("storefs_http_requests_total{kind=\"media\",status=\"206\"} 3\n"))
        #expect(text.contains("storefs_http_requests_total{kind=\"media\",status=\"0\"} 1\n"))
        #expect(text.contains("storefs_fuse_operations_total{op=\"read\"} 5\n"))
        #expect(text.contains("storefs_fuse_errors_total{errno=\"EIO\"} 2\n"))
        // Every sample belongs to a family announced with HELP and TYPE.
        var families = Set<String>()
        for line in text.split(separator: "\n") {
            if line.hasPrefix("# TYPE ") { families.insert(String(line.split(separator: " ")[2])) }
            if line.hasPrefix("#") { continue }
            let name = String(line.prefix { $0 != "{" && $0 != " " })
            let base = ["_bucket", "_sum", "_count"].reduce(name) { n, s in n.hasSuffix(s) && !families.contains(n) ? String(n.dropLast(s.count)) : n }
            #expect(families.contains(base), "\(name) has no TYPE line")
        }
    }

    /// Threads alive at once, each calling `body` on its own thread; returns when all have.
    private func onThreadsAtOnce(_ count: Int, _ body: @escaping @Sendable (Int) -> Void) {
        let started = DispatchGroup(), go = DispatchSemaphore(value: 0), done = DispatchGroup()
        for i in 0..<count {
            started.enter()
            done.enter()
            Thread {
                started.leave()
                go.wait()
                body(i)
                done.leave()
            }.start()
        }
        started.wait()
        for _ in 0..<count { go.signal() }
        done.wait()
    }

    @Test func sixteenThreadsCountInAtLeastEightStripes() {
        // Every FUSE reply is counted: threads that share a stripe wait for each other there.
        let seen = Mutex([Int]())
        onThreadsAtOnce(16) { _ in
            let stripe = Metrics.stripeIndex(of: pthread_self())
            seen.withLock { $0.append(stripe) }
            Thread.sleep(forTimeInterval: 0.05)  // alive until all have looked: no address reused
        }
        let stripes = seen.withLock { $0 }
        #expect(stripes.count == 16 && stripes.allSatisfy { (0..<Metrics.stripeCount).contains($0) })
        #expect(Set(stripes).count >= 8, "stripes of 16 threads: \(stripes.sorted())")
    }

    @Test func countsMadeOnManyThreadsAtOnceAllReachTheSnapshot() {
        let m = Metrics()
        m.nameOperations(["lookup", "read"])
        let threads = 24, each = 400
        onThreadsAtOnce(threads) { _ in
            for _ in 0..<each {
                m.operation(1, errno: 0, seconds: 0.003, bytes: 10, isRead: true)
                m.operation(0, errno: ENOENT, seconds: 0.0001)
                m.cacheRead(hit: true, bytes: 4)
                m.cacheRead(hit: false, bytes: 1)
                m.retried()
            }
            m.operations(0, count: 3)
            m.evicted(blocks: 2, bytes: 32)
        }
        let s = m.snapshot()
        let n = UInt64(threads * each)
        #expect(s.opNames == ["lookup", "read"])
        #expect(s.ops == [n + UInt64(3 * threads), n])
        #expect(s.errors == [ENOENT: n])
        #expect(s.readBytes == 10 * n && s.readLatency.count == n && s.readLatency.counts[4] == n)
        #expect(abs(s.readLatency.sum - 0.003 * Double(n)) < 1e-6)
        #expect(s.cacheHits == n && s.cacheMisses == n && s.cacheHitBytes == 4 * n && s.cacheMissBytes == n)
        #expect(s.retries == n && s.evictedBlocks == UInt64(2 * threads) && s.evictedBytes == UInt64(32 * threads))
    }

    @Test func metricsRoutesOnlyGetOfMetrics() {
        #expect(MetricsServer.route(Array("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".utf8)) == .metrics(head: false))
        #expect(MetricsServer.route(Array("HEAD /metrics?x=1 HTTP/1.1\r\n\r\n".utf8)) == .metrics(head: true))
        #expect(MetricsServer.route(Array("GET /metricsx HTTP/1.1\r\n\r\n".utf8)) == .notFound)
        #expect(MetricsServer.route(Array("POST /metrics HTTP/1.1\r\n\r\n".utf8)) == .badMethod)
        #expect(MetricsServer.route(Array("garbage".utf8)) == .notFound)
    }

    @Test func metricsServerBindsLoopbackAndRefusesNonsense() throws {
        let server = try MetricsServer(.tcp(host: "127.0.0.1", port: 0))
        #expect(server.port > 0 && server.bindProblem == nil)
        #expect(throws: MetricsServer.Refused.self) { try MetricsServer(.tcp(host: "not-an-address", port: 0)) }
    }

    /// A port another process holds is a warning to retry, not a failed mount (issue 43, item 4).
    @Test func aTakenPortIsABindProblemNotARefusal() throws {
        let first = try MetricsServer(.tcp(host: "127.0.0.1", port: 0))
        let second = try MetricsServer(.tcp(host: "127.0.0.1", port: first.port))
        #expect(second.port == 0)
        #expect(second.bindProblem?.contains("cannot listen there") == true && second.bindProblem?.contains("retrying") == true)
    }

    @Test func aUnixSocketIsOwnerAndGroupOnlyAndNeverReplacesAForeignFile() throws {
        let dir = NSTemporaryDirectory() + "storefs-metrics-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: false)
        defer { try? FileManager.default.removeItem(atPath: dir) }
        let path = dir + "/m.sock"
        do {
            let server = try MetricsServer(.unix(path: path))
            var st = stat()
            #expect(lstat(path, &st) == 0 && st.st_mode & S_IFMT == S_IFSOCK && st.st_mode & 0o777 == 0o660)
            // Served by this process: a second one is refused rather than stealing it.
            #expect(throws: MetricsServer.Refused.self) { try MetricsServer(.unix(path: path)) }
            withExtendedLifetime(server) {}
        }
        // Left behind by a run that is gone: replaced.
        #expect(throws: Never.self) { _ = try MetricsServer(.unix(path: path)) }
        let file = dir + "/plain"
        #expect(FileManager.default.createFile(atPath: file, contents: Data("x".utf8)))
        #expect(throws: MetricsServer.Refused.self) { try MetricsServer(.unix(path: file)) }
        #expect(FileManager.default.fileExists(atPath: file))
    }

    @Test func errnoNamesAreSymbolic() {
        #expect(Errno.name(2) == "ENOENT" && Errno.name(0) == "OK" && Errno.name(30) == "EROFS" && Errno.name(9999) == "E9999")
    }
}
