import Foundation
import StorageClient
import Synchronization
import Locking

/// The flights of one object generation. A flight covers a run of blocks; a block's flight is
/// the latest registered one that covers it.
final class FlightTable: Sendable {
    private struct Entries: ~Copyable {
        /// Each registered flight once, oldest first. They are few (the parts in flight and the
        /// finished ones not read yet), while their blocks are many (16 KiB blocks: an 8 MiB
        /// part is 512), so a lookup walks the flights: a table by block cost a hash and a probe
        /// per block of every read-ahead window, on every read (4% of the daemon's CPU).
        var flights: [Flight] = []

        func covering(_ block: Int) -> Flight? {
            flights.last { $0.firstBlock <= block && block <= $0.lastBlock }
        }

        func overlaps(_ blocks: ClosedRange<Int>) -> Bool {
            flights.contains { $0.firstBlock <= blocks.upperBound && blocks.lowerBound <= $0.lastBlock }
        }

        mutating func add(_ flight: Flight) { flights.append(flight) }

        mutating func remove(_ flight: Flight) { flights.removeAll { $0 === flight } }
    }

    private let entries = OrderedMutex(.flightEntries, Entries())
    /// The object's end-to-end check: which download completes it, and the downloads whose
    /// cache copy is not made yet (kept apart from `entries`, which lets finished flights go).
    let integrity = ObjectIntegrity()

    func flight(for block: Int) -> Flight? { entries.withLock { $0.covering(block) } }

    /// Registers `flight` unless `block` already has one (returned instead).
    func register(_ flight: Flight, orExistingFor block: Int) -> Flight? {
        entries.withLock { e in
            if let raced = e.covering(block) { return raced }
            e.add(flight)
            return nil
        }
    }

    /// Registers `flight` if none of its blocks has a flight yet.
    func registerIfFree(_ flight: Flight) -> Bool {
        entries.withLock { e in
            if e.overlaps(flight.firstBlock...flight.lastBlock) { return false }
            e.add(flight)
            return true
        }
    }

    /// For each block of `blocks`: does a flight bring it?
    func coveredMask(_ blocks: ClosedRange<Int>) -> [Bool] {
        var mask = [Bool](repeating: false, count: blocks.count)
        entries.withLock { e in
            for f in e.flights where f.firstBlock <= blocks.upperBound && blocks.lowerBound <= f.lastBlock {
                for b in max(f.firstBlock, blocks.lowerBound)...min(f.lastBlock, blocks.upperBound) {
                    mask[b - blocks.lowerBound] = true
                }
            }
        }
        return mask
    }

    func forget(_ flight: Flight) {
        entries.withLock { $0.remove(flight) }
    }

    var isEmpty: Bool { entries.withLock { $0.flights.isEmpty } && integrity.isEmpty }

    /// How long a reader's failed download answers new reads of its blocks with its error.
    /// The kernel reads a page again, synchronously, when a read of it failed: without this
    /// that second read made all its tries anew (up to `request_timeout` more) while the
    /// bucket answered other requests, so a `read` took twice the bound (test_faults.py,
    /// trickling media). A read a second later tries afresh.
    static let failureMemory = 1.0
    private let lastFailure = OrderedMutex<(blocks: ClosedRange<Int>, error: StorageError, at: Double)?>(.flightFailure, nil)

    func noteFailure(_ flight: Flight, _ error: StorageError) {
        lastFailure.withLock { $0 = (flight.firstBlock...flight.lastBlock, error, now()) }
    }

    func recentFailure(covering block: Int) -> StorageError? {
        lastFailure.withLock { f in
            guard let last = f, last.blocks.contains(block), now() - last.at < Self.failureMemory else { return nil }
            return last.error
        }
    }

    /// Lets go of every finished flight (the object was found wrong, or closed by all).
    func dropFinished() {
        entries.withLock { e in
            for flight in e.flights where flight.finished != nil { e.remove(flight) }
        }
    }

    /// Lets go of the finished flights whose cache copy is made or skipped (memory runs short).
    /// One that waits for its cache write stays: the thread that writes it holds it (and its
    /// budget) until the write ends, when it leaves by itself if its bytes are cached. Letting
    /// it go freed nothing and left its bytes neither here nor in the cache yet, so the
    /// reader right behind fetched them again (test_link.py, a loaded 2-core machine).
    func dropStored() {
        entries.withLock { e in
            for flight in e.flights where flight.isFinishedAndStored { e.remove(flight) }
        }
    }
}
