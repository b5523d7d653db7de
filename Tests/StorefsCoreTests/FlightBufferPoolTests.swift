import Foundation
import Testing
@testable import StorefsCore

/// Download buffers are recycled within a bound on resident bytes that counts the regions in
/// use as well as the free ones (docs/architecture.md, "Adaptive transfers": Buffers).
@Suite struct FlightBufferPoolTests {
    static let mib = 1 << 20

    func touched(_ pool: FlightBufferPool, _ length: Int) -> UnsafeMutableRawBufferPointer {
        let b = pool.take(length)
        for i in stride(from: 0, to: b.count, by: 4096) { b[i] = 1 }
        return b
    }

    @Test func regionsInUseCountAgainstWhatIsKept() {
        let pool = FlightBufferPool(regionSize: 4 * Self.mib, keepBytes: 8 * Self.mib)
        // Six 2 MiB parts at once: 12 MiB resident while in use.
        let parts = (0..<6).map { _ in touched(pool, 2 * Self.mib) }
        #expect(pool.keptBytes.all == 12 * Self.mib)
        for p in parts { pool.give(p) }
        // Given back, only what fits in 8 MiB of all regions stays mapped.
        #expect(pool.keptBytes.all <= 8 * Self.mib)
        #expect(pool.keptBytes.free == pool.keptBytes.all)
        // A recycled region used for a larger part counts what that part touched.
        let big = touched(pool, 4 * Self.mib)
        #expect(pool.keptBytes.all <= 10 * Self.mib)
        pool.give(big)
        pool.releaseIfIdle(for: 0)
        #expect(pool.keptBytes.all == 0 && pool.keptBytes.free == 0)
    }

    @Test func freeRegionsBesideAFullBudgetAreNotKept() {
        // The old bound (free regions only, up to keepBytes) kept 8 MiB free beside 8 MiB in use.
        let pool = FlightBufferPool(regionSize: 2 * Self.mib, keepBytes: 8 * Self.mib)
        let first = (0..<4).map { _ in touched(pool, 2 * Self.mib) }
        let second = (0..<4).map { _ in touched(pool, 2 * Self.mib) }
        for p in first { pool.give(p) }
        #expect(pool.keptBytes.all <= 8 * Self.mib + 2 * Self.mib, "\(pool.keptBytes)")
        for p in second { pool.give(p) }
        #expect(pool.keptBytes.all <= 8 * Self.mib + 2 * Self.mib)
    }
}
