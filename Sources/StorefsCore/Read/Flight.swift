import Foundation
import Glibc
import StorageClient
import Locking

/// One ranged download of consecutive blocks, shared by every reader that needs any of them
/// (single flight). Readers wait on it and copy from its buffer, so a download serves its
/// waiters even when the disk cache is off. The buffer is charged to the memory budget
/// until the last reference goes.
final class Flight: @unchecked Sendable {
    let firstBlock: Int
    let blockCount: Int
    let start: Int64
    let length: Int
    /// Scheduled ahead of its reader (not a reader's own miss).
    let isReadAhead: Bool
    /// Kept in memory once cached until a reader has copied it to its end (or the file is
    /// closed, or memory runs short): read-ahead, and a small file fetched whole by its first
    /// read, whose reader comes back for the rest (`BlockReader.storeToCache`).
    let keptUntilRead: Bool
    /// Taken from the pool when the download starts (`beginDownload`), so read-ahead queued
    /// behind busy threads holds budget but no memory. Readers use it only after `finish`.
    private(set) var buffer = UnsafeMutableRawBufferPointer(start: nil, count: 0)
    /// Its blocks' CRC32Cs when its check computed them (`ObjectIntegrity.landed`): set before
    /// `finish`, read after it by the thread that stores its cache copy, which then need not
    /// compute them again.
    var blockCRCs: [UInt32]?
    private let budget: MemoryBudget
    private let condition = OrderedCondition(.flight)
    private var outcome: Result<Void, StorageError>?
    private var consumed = false
    private var stored = false
    private var claimed = false

    private let pool: FlightBufferPool
    /// The download asks during an outage (`BucketHealth.admit`): ended once it noted what it
    /// found, or at the latest with the flight.
    let probe: BucketHealth.Probe?

    init(firstBlock: Int, blockCount: Int, start: Int64, length: Int, isReadAhead: Bool = false,
         keptUntilRead: Bool? = nil, budget: MemoryBudget, pool: FlightBufferPool, probe: BucketHealth.Probe? = nil) {
        self.keptUntilRead = keptUntilRead ?? isReadAhead
        self.probe = probe
        self.firstBlock = firstBlock
        self.blockCount = blockCount
        self.start = start
        self.length = length
        self.isReadAhead = isReadAhead
        self.budget = budget
        self.pool = pool
    }

    deinit {
        if buffer.baseAddress != nil { pool.give(buffer) }
        budget.release(Int64(length))
    }

    /// Takes the download on: true for exactly one caller. Read-ahead queued behind other
    /// files' downloads is claimed by the first reader that needs it, which downloads it
    /// itself instead of waiting for a prefetch thread (no head-of-line wait).
    func claim() -> Bool {
        condition.lock()
        defer { condition.unlock() }
        if claimed { return false }
        claimed = true
        return true
    }

    /// The buffer to download into; called once, by the thread that runs the download.
    func beginDownload() -> UnsafeMutableRawBufferPointer {
        condition.lock()
        defer { condition.unlock() }
        if buffer.baseAddress == nil { buffer = pool.take(length) }
        return buffer
    }

    var end: Int64 { start + Int64(length) }

    func contains(block: Int) -> Bool { block >= firstBlock && block < firstBlock + blockCount }

    var lastBlock: Int { firstBlock + blockCount - 1 }

    /// The outcome if the download has finished; never waits.
    var finished: Result<Void, StorageError>? {
        condition.lock()
        defer { condition.unlock() }
        return outcome
    }

    /// Finished, and its cache copy made (or skipped): letting it go frees its buffer. Until
    /// then the thread that writes the copy holds the flight, so letting it go would free
    /// nothing, only hide bytes that are not in the cache yet (`FlightTable.dropStored`).
    var isFinishedAndStored: Bool {
        condition.lock()
        defer { condition.unlock() }
        return outcome != nil && stored
    }

    /// A reader copied the last block. True when the disk copy is done too, so the flight
    /// can go: until then it must stay findable, or read-ahead would fetch the range again.
    func markConsumed() -> Bool {
        condition.lock()
        defer { condition.unlock() }
        consumed = true
        return stored
    }

    /// The cache write finished (or was skipped). True when a reader already took the last block.
    func markStored() -> Bool {
        condition.lock()
        defer { condition.unlock() }
        stored = true
        return consumed
    }

    func finish(_ result: Result<Void, StorageError>) {
        condition.lock()
        outcome = result
        condition.broadcast()
        condition.unlock()
    }

    /// Waits for the download; nil if the waiting reader was interrupted first.
    func wait(isCancelled: (@Sendable () -> Bool)?) -> Result<Void, StorageError>? {
        condition.lock()
        defer { condition.unlock() }
        while outcome == nil {
            if let isCancelled, isCancelled() { return nil }
            _ = condition.wait(until: Date().addingTimeInterval(0.05))
        }
        return outcome
    }
}

/// Download buffers, recycled: a fresh multi-MiB mapping costs a page fault and a zeroed page
/// per 4 KiB (about a fifth of the CPU of a cold read here, and more on a VM whose free pages
/// the host has taken back). Regions are mmap'd rather than malloc'd so that memory given back
/// really leaves the process (glibc's arenas would keep it).
///
/// What is kept is bounded by resident bytes, not by a count of regions: a region is as large
/// as the largest part, but only the pages a part touched are resident, so counting regions
/// either kept too few (8 MiB parts in 32 MiB regions: 24 parts in flight re-faulted two
/// thirds of their pages on every part) or bounded nothing once parts grew. The bound counts
/// the regions in use too: with only the free ones counted, free regions up to `memory_limit`
/// beside parts in flight up to `memory_limit` let 8 readers reach twice that. And a recycled
/// region that holds more than its new part asks gives the rest back while the pool is over
/// its bound: a region a 32 MiB part touched, reused for an 8 MiB one, held 32 MiB against
/// the budget's 8.
final class FlightBufferPool: @unchecked Sendable {
    let regionSize: Int
    /// Resident bytes all regions, in use or free, may hold before a freed one is unmapped.
    private let keepBytes: Int
    private var free: [(region: UnsafeMutableRawPointer, touched: Int)] = []
    private var freeBytes = 0
    /// Resident bytes of every region mapped here (handed out or free).
    private var residentBytes = 0
    /// Bytes touched in each region handed out, so a recycled region is counted as what it
    /// holds resident, not as what its current part asked.
    private var touched: [UnsafeMutableRawPointer: Int] = [:]
    private var lastUse = 0.0
    private let lock = OrderedLock(.flightBuffers)

    init(regionSize: Int, keepBytes: Int) {
        self.regionSize = (regionSize + 4095) / 4096 * 4096
        self.keepBytes = keepBytes
        MemoryReturn.register { [weak self] idle in self?.releaseIfIdle(for: idle) ?? false }
    }

    /// Unmaps the kept regions once the pool has not been used for `idle` seconds: a load's
    /// buffers do not stay resident after it (they are mapped again, at a page fault each, on
    /// the next load). True when it unmapped any.
    @discardableResult
    func releaseIfIdle(for idle: Double) -> Bool {
        lock.lock()
        guard now() - lastUse >= idle, !free.isEmpty else {
            lock.unlock()
            return false
        }
        let released = free
        free.removeAll()
        residentBytes -= freeBytes
        freeBytes = 0
        lock.unlock()
        for r in released { munmap(r.region, regionSize) }
        return true
    }

    deinit { for r in free { munmap(r.region, regionSize) } }

    /// Resident bytes held by free regions, and by all regions (tests).
    var keptBytes: (free: Int, all: Int) {
        lock.lock()
        defer { lock.unlock() }
        return (freeBytes, residentBytes)
    }

    static let hugePage = 2 << 20

    func take(_ length: Int) -> UnsafeMutableRawBufferPointer {
        if length <= regionSize {
            lock.lock()
            lastUse = now()
            if let r = free.popLast() {
                freeBytes -= r.touched
                var held = max(r.touched, length)
                let needed = (length + 4095) / 4096 * 4096
                if held > needed, residentBytes + (held - r.touched) > keepBytes {
                    // The pages past this part go back (a larger part later faults them in again).
                    madvise(r.region + needed, held - needed, MADV_DONTNEED)
                    held = needed
                }
                residentBytes += held - r.touched
                touched[r.region] = held
                lock.unlock()
                return UnsafeMutableRawBufferPointer(start: r.region, count: length)
            }
            lock.unlock()
        }
        let size = max(length, regionSize)
        let p = mmap(nil, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        guard let p, p != MAP_FAILED else { fatalError("out of memory mapping a \(size)-byte download buffer") }
        // Huge pages where the kernel offers them (THP in `madvise` mode, Debian's default): a
        // fresh part faulted in a 4 KiB page at a time cost ~6% of the daemon's CPU on a cold
        // read (each fault a VM exit here); 2 MiB pages take 512 times fewer.
        if size >= Self.hugePage { _ = madvise(p, size, MADV_HUGEPAGE) }
        if size == regionSize {
            lock.lock()
            touched[p] = length
            residentBytes += length
            lock.unlock()
        }
        return UnsafeMutableRawBufferPointer(start: p, count: length)
    }

    func give(_ buffer: UnsafeMutableRawBufferPointer) {
        let size = max(buffer.count, regionSize)
        if size == regionSize, let p = buffer.baseAddress {
            lock.lock()
            lastUse = now()
            let held = touched.removeValue(forKey: p) ?? regionSize
            if residentBytes <= keepBytes {
                free.append((p, held))
                freeBytes += held
                lock.unlock()
                return
            }
            residentBytes -= held
            lock.unlock()
        }
        munmap(buffer.baseAddress, size)
    }
}
