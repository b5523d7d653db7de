import Testing
@testable import StorageClient

@Suite struct StorageTelemetryTests {
    @Test(arguments: [
        ("http://h/storage/v1/b/bk/o?prefix=a%2F&delimiter=%2F", false, false, RequestKind.list),
        ("http://h/v0/b/bk/o?prefix=a%2F&delimiter=%2F", false, false, .list),
        ("http://h/storage/v1/b/bk/o/a%2Fb.bin?fields=size", false, false, .metadata),
        ("http://h/storage/v1/b/bk", false, false, .metadata),
        ("http://h/v0/b/bk/o/a%2Fb.bin", false, false, .metadata),
        ("http://h/download/storage/v1/b/bk/o/a.bin?alt=media&generation=3", false, false, .media),
        ("http://h/v0/b/bk/o/a.bin?alt=media", false, true, .media),
        ("http://h/storage/v1/b/bk/o/o?generation=1", false, true, .media),
        ("http://h/token", true, false, .token),
        ("http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token", false, false, .token),
    ])
    func requestKinds(url: String, post: Bool, ranged: Bool, kind: RequestKind) {
        #expect(RequestKind.of(url: url, isPost: post, isRanged: ranged) == kind)
    }

    /// Log lines carry the target without the query (keys, tokens) or a user:password.
    @Test func targetsDropQueriesAndCredentials() {
        #expect(StorageTelemetry.target(of: "https://u:p@h:8/v0/b/b/o/x?alt=media&token=SECRET") == "https://h:8/v0/b/b/o/x")
        #expect(StorageTelemetry.target(of: "http://h/p#frag") == "http://h/p")
        #expect(StorageTelemetry.target(of: "http://h/a@b/c") == "http://h/a@b/c")
    }

    @Test func retriesRunWithTheirTryNumberAndAnInnerOperationCountsItsOwn() throws {
        var seen: [Int] = []
        var inner: [Int] = []
        let policy = RetryPolicy(attempts: 3, firstDelay: 0.001, maxDelay: 0.002, budget: 5)
        _ = try? policy.run { t throws(StorageError) -> Int in
            seen.append(t.number)
            // A token fetch runs inside a read's try, with tries of its own.
            _ = try? RetryPolicy(attempts: 2, firstDelay: 0.001, maxDelay: 0.002, budget: 5).run { u throws(StorageError) -> Int in
                inner.append(u.number)
                throw StorageError(.retryLimitExceeded, "again")
            }
            throw StorageError(.retryLimitExceeded, "again")
        }
        #expect(seen == [1, 2, 3])
        #expect(inner == [1, 2, 1, 2, 1, 2])
    }
}
