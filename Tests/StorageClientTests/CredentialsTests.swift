import Foundation
import Synchronization
import Testing
@testable import StorageClient

/// How credentials renew: ahead of expiry, and once — not once per failed request — after 401s.
@Suite struct CredentialsTests {
    /// A token service that counts its calls and hands out tok-1, tok-2, … valid for an hour.
    final class Service: Sendable {
        let calls = Atomic<Int>(0)
        func fetch(_ previous: AccessToken?) -> AccessToken {
            let n = calls.add(1, ordering: .relaxed).newValue
            return AccessToken(value: "tok-\(n)", expiresAt: wallClock() + 3600)
        }
    }

    @Test func requestsRejectedWithTheSameTokenCauseOneRefresh() throws {
        let service = Service()
        let creds = RefreshingCredentials(scheme: "Bearer", label: "test") { previous in service.fetch(previous) }
        let first = try creds.authorization(rejected: nil)
        #expect(first == "Bearer tok-1")
        // Eight requests went out with tok-1 and all came back 401; they ask one after another
        // (the worst order: each sees the token the previous one installed).
        var seen: Set<String> = []
        for _ in 0..<8 { seen.insert(try creds.authorization(rejected: first) ?? "") }
        #expect(service.calls.load(ordering: .relaxed) == 2, "one fetch at start, one forced refresh")
        #expect(seen == ["Bearer tok-2"])
    }

    @Test func aTokenARejectionForcedIsNotRenewedAgainUntilTheSpacingHasPassed() throws {
        let service = Service()
        let creds = RefreshingCredentials(scheme: "Bearer", label: "test", forcedRefreshSpacing: 0.3) {
            previous in service.fetch(previous)
        }
        let first = try creds.authorization(rejected: nil)
        #expect(try creds.authorization(rejected: first) == "Bearer tok-2")
        // Requests sent with tok-2 come back 401 as well: nothing newer (the caller's 401
        // stands), however many ask.
        for _ in 0..<4 { #expect(try creds.authorization(rejected: "Bearer tok-2") == "Bearer tok-2") }
        #expect(service.calls.load(ordering: .relaxed) == 2)
        Thread.sleep(forTimeInterval: 0.4)
        #expect(try creds.authorization(rejected: "Bearer tok-2") == "Bearer tok-3")
        #expect(try creds.authorization(rejected: nil) == "Bearer tok-3")
    }

    @Test func concurrentRejectionsShareOneRefresh() async throws {
        let service = Service()
        let creds = RefreshingCredentials(scheme: "Bearer", label: "test") { previous in service.fetch(previous) }
        let first = try creds.authorization(rejected: nil)
        let results = await withTaskGroup(of: String?.self) { group in
            for _ in 0..<16 { group.addTask { try? creds.authorization(rejected: first) } }
            var all: [String?] = []
            for await r in group { all.append(r) }
            return all
        }
        #expect(Set(results) == ["Bearer tok-2"])
        #expect(service.calls.load(ordering: .relaxed) == 2)
    }

    @Test func aTokenNearExpiryIsRenewedBeforeUse() throws {
        let calls = Atomic<Int>(0)
        let creds = RefreshingCredentials(scheme: "Bearer", label: "test") { _ in
            let n = calls.add(1, ordering: .relaxed).newValue
            // The first token expires inside the refresh margin, the second an hour from now.
            return AccessToken(value: "tok-\(n)", expiresAt: wallClock() + (n == 1 ? 60 : 3600))
        }
        #expect(try creds.authorization(rejected: nil) == "Bearer tok-1")
        #expect(try creds.authorization(rejected: nil) == "Bearer tok-2")
        #expect(try creds.authorization(rejected: nil) == "Bearer tok-2")
        #expect(calls.load(ordering: .relaxed) == 2)
    }
}
