import Testing
@testable import FuseAdapter

/// The bound on reads served on FUSE threads (docs/architecture.md, "Threads"): past it a miss
/// goes to a read worker, so a stalled server never holds every FUSE thread.
@Suite struct InlineMissesTests {
    @Test func placesAreTakenUpToTheLimitAndFreedByLeaving() {
        let misses = InlineMisses(limit: 3)
        #expect((0..<3).allSatisfy { _ in misses.enter() })
        #expect(!misses.enter(), "a fourth miss at once must go to a worker")
        #expect(!misses.enter(), "a refused place is not counted")
        misses.leave()
        #expect(misses.enter(), "a place given back is taken again")
        #expect(!misses.enter())
    }
}
