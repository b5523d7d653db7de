import Foundation
import StorageClient
import Synchronization
import Locking

/// How many read-ahead parts may download at once, and how large they are, found from the
/// link itself (docs/architecture.md, "Adaptive transfers").
///
/// The decisions are `TransferPlan`'s, a value with no clock or lock of its own, so they can
/// be driven by a simulated link in tests; `TransferController` adds the clock, the lock and the
/// gate that read-ahead downloads pass before they start (`PartQueue`: fair between readers).
///
/// The idea: aggregate throughput is measured over epochs of at least a few completed parts.
/// While the readers keep every slot busy (there is always a part waiting), the number of parts
/// in flight doubles (then grows by a quarter) as long as each step brings at least `gain`
/// more throughput. Where a step up does not pay (or the count is at its ceiling), the count
/// steps down by a quarter while throughput stays within `tolerance` of the best: where the
/// daemon's CPU, not the link, sets the pace (loopback), fewer parts move as much and touch
/// less memory. Then the count holds for a while before it is probed again. And where no reader
/// had to wait for a part during an epoch, the read-ahead is ahead of its readers: the count
/// steps down without a comparison (a slow reader, or the daemon's own copies, set the pace). Where the first byte of a part takes a large share of its time (a link
/// far away), parts double in size. Refusals (429, 503) halve the count. Everything stays
/// within `maxParts` and within `memoryLimit` (parts × size).
struct TransferPlan: Equatable {
    struct Limits: Equatable {
        var startParts = 8
        var minParts = 2
        /// `MountOptions.maxParallel` by default.
        var maxParts = 48
        /// Parts start this large (`parallel=` fixes its own size, 8 MiB): the bytes in flight
        /// that fill a link are its rate × (first byte + part ÷ a connection's rate), least
        /// for small parts, so more parts beat larger ones and parts grow only once the count
        /// cannot (`endEpoch`). Through `wan` and `harsh`, up to 48 parts of 2 MiB moved as much
        /// as or more than 32 of 4 MiB with 15–20% less peak RSS (docs/architecture.md,
        /// "Adaptive transfers": Size).
        static let adaptiveStartPartSize: Int64 = 2 << 20
        var startPartSize: Int64 = adaptiveStartPartSize
        var maxPartSize: Int64 = 32 << 20
        /// Bytes all parts in flight may hold.
        var memoryLimit: Int64 = 256 << 20
        /// A fixed count (`parallel=`): no adapting of the count.
        var fixedParts: Int? = nil
        /// Throughput must grow by this factor for a step up to stay.
        var gain = 1.12
        /// A step down stays while throughput is within this fraction of the best measured.
        var tolerance = 0.05
        /// Epochs a count holds after a step up did not pay, before it is probed again.
        var holdEpochs = 12
        /// A server that answers within this many seconds is near (loopback, the same rack):
        /// few parts fill what little lies between, so the count starts at `nearStartParts`
        /// instead, and grows from there only if more parts pay.
        var nearFirstByte = 0.003
        /// Before any download has landed, a server whose fastest answer yet (a lookup's) took
        /// this long to its first byte is taken for far: connections are opened ahead for it.
        /// (The latest answer was used at first: with 8 readers on loopback a busy machine made
        /// one slow enough, connections were opened and peak RSS rose from ~200 to ~345 MiB.)
        var farHint = 0.01
        var nearStartParts = 4
        /// Parts start this large near the server (never above `startPartSize`): a first byte
        /// that comes at once is no reason for large parts, and every byte in flight is a
        /// resident, page-faulted buffer (loopback, 8 readers: 11% of the daemon's CPU went to
        /// faulting in 8 MiB parts). Nor do they grow there (`endEpoch`).
        var nearPartSize: Int64 = 2 << 20
        /// And at most this many run at once near the server: there the daemon's CPU sets the
        /// pace, a step up that seems to pay is the ramp of readers still joining, and each
        /// part more is buffers to fault in and hold.
        var nearMaxParts = 8
        /// Shortest epoch, seconds.
        var minEpoch = 0.12
        /// An epoch ends by this many seconds even with few parts done.
        var maxEpoch = 3.0
    }

    let limits: Limits
    private(set) var parts: Int
    private(set) var partSize: Int64
    /// `limits.maxParts`, or `nearMaxParts` once the server is found near.
    private var maxParts: Int
    /// The mount's first download had its first byte within `nearFirstByte`: the daemon's CPU,
    /// not the link, sets the pace (whether or not `parallel=` fixes the count).
    private(set) var isNear = false
    /// The best count measured so far and its throughput (bytes/s).
    private(set) var best: (parts: Int, rate: Double)? = nil
    private var slowStart = true
    /// The count the last completed part saw, and when the count took its current value.
    private var countBefore = 0
    private var countChangedAt = -Double.infinity
    /// The first part's wait for its first byte has set the starting count.
    private(set) var startJudged = false
    private var holdLeft = 0
    // The epoch under way.
    private var epochStart: Double
    private var epochBytes: Int64 = 0
    private var epochParts = 0
    private var epochSaturated = false
    private var epochReaderWaited = false
    private var epochFirstByte = 0.0
    private var epochPartTime = 0.0

    init(limits: Limits, now: Double) {
        self.limits = limits
        partSize = limits.startPartSize
        maxParts = limits.maxParts
        parts = 0
        epochStart = now
        parts = limits.fixedParts ?? 0
        if limits.fixedParts == nil { parts = clamp(limits.startParts) }
    }

    static func == (a: TransferPlan, b: TransferPlan) -> Bool { a.parts == b.parts && a.partSize == b.partSize }

    /// The most parts that fit in memory at the current size.
    private var memoryParts: Int { max(1, Int(limits.memoryLimit / max(1, partSize))) }

    /// `n` within [minParts, min(maxParts, what fits in memory)].
    private func clamp(_ n: Int) -> Int {
        max(1, min(max(n, limits.minParts), maxParts, memoryParts))
    }

    /// The count a step up would reach from here (the count itself where none can): `stepUp`
    /// takes it, and connections are opened for it ahead, so that a step's parts find them open.
    var nextParts: Int {
        guard limits.fixedParts == nil else { return parts }
        return clamp(slowStart ? parts * 2 : parts + max(1, parts / 4))
    }

    /// A slot was wanted while every slot was busy: the readers would take more.
    mutating func noteWaiting() { epochSaturated = true }

    /// A download of the mount (the first, a reader's own usually, before any read-ahead) waited
    /// `firstByte` seconds for its first byte. The first sets the starting count, before the
    /// readers' windows open to it; a later one that comes within `nearFirstByte` still finds
    /// the server near (a busy machine can slow any one answer, nothing makes a far server
    /// answer fast: 8 readers starting at once on loopback made the first slow in 2 of 5 runs,
    /// and 24 parts of 8 MiB were faulted in for a server 0.2 ms away).
    mutating func judgeStart(firstByte: Double) {
        if firstByte < limits.nearFirstByte {
            becomeNear()
        } else if !startJudged {
            startJudged = true
            isNear = false
        }
    }

    /// Another answer of the server's (a lookup, the start-up listing) came after `seconds`:
    /// near if within `nearFirstByte`. A slower one says nothing (the server may take longer
    /// over metadata than over bytes), so the first download still judges.
    mutating func noteAnswer(seconds: Double) {
        if seconds < limits.nearFirstByte { becomeNear() }
    }

    private mutating func becomeNear() {
        guard !(startJudged && isNear) else { return }
        let judgedFar = startJudged
        startJudged = true
        isNear = true
        guard limits.fixedParts == nil else { return }
        partSize = min(partSize, limits.nearPartSize)
        maxParts = min(maxParts, max(limits.nearMaxParts, limits.minParts))
        parts = clamp(min(parts, limits.nearStartParts))
        if judgedFar {
            // What was measured far says nothing near.
            best = nil
            holdLeft = 0
        }
    }

    /// A reader waited for a part still downloading: the link is behind the readers.
    mutating func noteReaderWaited() { epochReaderWaited = true }

    /// A part starts while none is running: an epoch measures from here, not from the last
    /// one's end (mount time, for the first), or an idle gap would count as a slow link and
    /// any step up after it would look like a gain.
    mutating func startedAfterIdle(now: Double) { restartEpoch(now) }

    /// A part finished: `bytes` in `seconds`, the first of them after `firstByte` seconds.
    mutating func completed(bytes: Int64, seconds: Double, firstByte: Double, now: Double) {
        judgeStart(firstByte: firstByte)
        // A part that started before the count last changed ran (partly) under the previous
        // count: counting it would credit a step down with the parts still in flight from above.
        if parts != countBefore {
            countBefore = parts
            countChangedAt = epochStart
        }
        guard now - seconds >= countChangedAt - 0.001 || now - epochStart >= limits.maxEpoch else { return }
        epochBytes += bytes
        epochParts += 1
        epochFirstByte += firstByte
        epochPartTime += seconds
        let elapsed = now - epochStart
        guard (epochParts >= max(2, parts) && elapsed >= limits.minEpoch) || elapsed >= limits.maxEpoch else { return }
        endEpoch(elapsed: elapsed, now: now)
    }

    /// A part was refused for load (429, 503) or failed in transfer: fewer at once.
    mutating func refused(now: Double) {
        guard limits.fixedParts == nil else { return }
        parts = clamp(max(limits.minParts, parts / 2))
        best = nil
        slowStart = false
        holdLeft = limits.holdEpochs
        restartEpoch(now)
    }

    private mutating func restartEpoch(_ now: Double) {
        epochStart = now
        epochBytes = 0
        epochParts = 0
        epochSaturated = false
        epochReaderWaited = false
        epochFirstByte = 0
        epochPartTime = 0
    }

    private mutating func endEpoch(elapsed: Double, now: Double) {
        defer { restartEpoch(now) }
        // Throughput with every slot busy: the count times one part's bytes per second (Little's
        // law), from the parts that ran wholly under this count. Bytes over the epoch's time
        // would count the ramp of a new count (its parts all start together) as the count's.
        let rate = epochPartTime > 0 ? Double(epochBytes) / epochPartTime * Double(parts) : Double(epochBytes) / max(elapsed, 1e-6)
        // Parts grow where waiting for the first byte would be a large share of a full part's
        // time. Judged per byte, not from the parts' own times: the first parts of a stream are
        // small (the window is still opening) and would all look like waiting. And only where
        // the count has left slow start and cannot grow (its ceiling, or `parallel=`): until
        // then new connections add their set-up to the wait, and more parts beat larger ones
        // (their first bytes are waited for side by side; a larger part holds more memory per
        // connection for the same speed). Parts that doubled as soon as the count settled
        // below its ceiling (18 of 8 MiB through `wan`, where 18 of 4 MiB move as much) held
        // 270 MiB where 190 do. Nor where the grown parts would hold more than half of what
        // parts in flight may: 48 parts grown to 4 MiB through `harsh` moved no more than 48 of
        // 2 MiB (1 GiB: 348–365 against 377–382 MiB/s) and held ~100 MiB more (peak RSS
        // 258–276 against 155–160 MiB). Never near the server:
        // there the wait is the machine's load (a busy server, 8 readers on 2 cores), which no
        // part size shortens, and parts grown to 16 MiB took 8 readers on loopback past their
        // memory bound (docs/architecture.md, "Adaptive transfers": Size).
        if limits.fixedParts != nil || (!slowStart && clamp(parts + 1) == parts), !isNear, epochParts > 0,
           partSize < limits.maxPartSize, Int64(parts) * partSize * 2 <= limits.memoryLimit / 2 {
            let wait = epochFirstByte / Double(epochParts)
            let moving = epochPartTime - epochFirstByte
            if moving > 0 {
                let perPart = Double(epochBytes) / moving  // bytes/s of one part once it flows
                if wait / (wait + Double(partSize) / perPart) > 0.25 { partSize *= 2 }
            }
        }
        guard limits.fixedParts == nil else { return }
        // Readers that do not keep the slots busy say nothing about the link.
        guard epochSaturated, epochParts > 0 else { return }
        // Readers that never waited for a part were kept ahead of: fewer parts will do.
        guard epochReaderWaited else {
            let lower = clamp(parts - max(1, parts / 4))
            if lower < parts {
                parts = lower
                best = nil
                slowStart = false
                holdLeft = 0
            }
            return
        }
        if holdLeft > 0 {
            holdLeft -= 1
            if let b = best, b.parts == parts, rate < b.rate * 0.7 { best = (parts, rate) }  // the link got slower
            if holdLeft == 0 { stepUp() }
            return
        }
        guard let b = best else {
            best = (parts, rate)
            stepUp()
            return
        }
        if parts > b.parts {
            if rate >= b.rate * limits.gain {
                best = (parts, rate)
                stepUp()
            } else {
                // The step did not pay: back to the best count, and see whether fewer do as well.
                parts = clamp(b.parts)
                slowStart = false
                stepDown()
            }
        } else if parts < b.parts {
            if rate >= b.rate * (1 - limits.tolerance) {
                // As fast with fewer: keep them, and try fewer still. The best rate stays the
                // reference, so small losses cannot add up step after step.
                best = (parts, b.rate)
                stepDown()
            } else {
                parts = clamp(b.parts)
                holdLeft = limits.holdEpochs
            }
        } else {
            best = (parts, max(rate, parts == b.parts ? b.rate : rate))
            stepUp()
        }
    }

    private mutating func stepUp() {
        let grown = nextParts
        if grown == parts {
            // At a ceiling: nothing to probe above, so probe below.
            slowStart = false
            stepDown()
            return
        }
        parts = grown
    }

    private mutating func stepDown() {
        let lower = clamp(parts - max(1, parts / 4))
        if lower == parts {
            holdLeft = limits.holdEpochs  // at the floor: nothing to probe
            return
        }
        parts = lower
    }
}

/// `TransferPlan` with a clock and a lock, and the gate read-ahead downloads pass: at most
/// `parts` of them run at once, a free slot going to the reader with the fewest running
/// (`PartQueue`). A part waits in the queue, not on a thread: it is handed to its pool only
/// once it has a slot, so parts that wait can never hold every thread while another reader's
/// parts sit behind them in the pool's own queue.
final class TransferController: Sendable {
    /// A queued part: what it runs, and on which threads.
    struct Job: Sendable {
        let pool: WorkerPool
        let run: @Sendable () -> Void
    }

    private struct State: ~Copyable {
        var plan: TransferPlan
        var queue = PartQueue<ReaderID, Job>()
    }

    private let state: OrderedMutex<State>
    let limits: TransferPlan.Limits
    /// The store's fastest answer yet (`ObjectStore.fastestFirstByte`).
    private let fastestAnswer: @Sendable () -> Double?

    init(limits: TransferPlan.Limits, fastestAnswer: @escaping @Sendable () -> Double? = { nil }) {
        self.limits = limits
        self.fastestAnswer = fastestAnswer
        state = OrderedMutex(.transfers, State(plan: TransferPlan(limits: limits, now: monotonicNow())))
    }

    /// Parts allowed in flight now.
    var parts: Int { state.withLock { $0.plan.parts } }
    /// Size of the next read-ahead part.
    var partSize: Int64 { state.withLock { $0.plan.partSize } }
    /// All at once, under one lock (every read asks: a FUSE thread's hot path), with how many
    /// readers share the slots if `reader` asks for more (`sharingReaders`) and what a step up
    /// would take the count to (`TransferPlan.nextParts`: connections are opened for it). Until
    /// the server is found near, the store's fastest answer (a lookup's) may say so first.
    func current(for reader: ReaderID) -> (parts: Int, partSize: Int64, isNear: Bool, readers: Int, nextParts: Int) {
        state.withLock { s in
            noteFastestAnswer(&s)
            return (s.plan.parts, s.plan.partSize, s.plan.isNear, Self.sharing(s.queue, with: reader), s.plan.nextParts)
        }
    }
    /// The same without the readers (tests).
    var current: (parts: Int, partSize: Int64, isNear: Bool) {
        state.withLock { s in
            noteFastestAnswer(&s)
            return (s.plan.parts, s.plan.partSize, s.plan.isNear)
        }
    }

    private func noteFastestAnswer(_ s: inout State) {
        if !s.plan.isNear, let seconds = fastestAnswer() { s.plan.noteAnswer(seconds: seconds) }
    }
    /// The server is near (`TransferPlan.isNear`).
    var isNear: Bool { state.withLock { $0.plan.isNear } }
    /// The server is far: a download said so, or, before any has landed, the store's fastest
    /// answer's first byte (`Limits.farHint`).
    var seemsFar: Bool {
        state.withLock { $0.plan.startJudged ? !$0.plan.isNear : nil } ?? ((fastestAnswer() ?? 0) >= limits.farHint)
    }
    /// Parts downloading now.
    var running: Int { state.withLock { $0.queue.running } }
    /// Readers (open files) with read-ahead waiting or running, `reader` counted whether or not
    /// it has any: how many share the slots if `reader` asks for more.
    func sharingReaders(with reader: ReaderID) -> Int {
        state.withLock { Self.sharing($0.queue, with: reader) }
    }

    private static func sharing(_ queue: borrowing PartQueue<ReaderID, Job>, with reader: ReaderID) -> Int {
        queue.readers + (queue.isSharing(reader) ? 0 : 1)
    }

    /// A download other than read-ahead (a reader's own) got its first byte after `firstByte`.
    func noteFirstByte(_ firstByte: Double) { state.withLock { $0.plan.judgeStart(firstByte: firstByte) } }

    /// A reader waits for a part still downloading.
    func noteReaderWaited() { state.withLock { $0.plan.noteReaderWaited() } }

    /// Queues a read-ahead part of `reader`'s: `run` goes to `pool` once the part has a slot,
    /// and must give it back with `release(for: reader, …)`.
    func enqueue(for reader: ReaderID, on pool: WorkerPool, _ run: @escaping @Sendable () -> Void) {
        let ready = state.withLock { s -> [Job] in
            s.queue.add(Job(pool: pool, run: run), for: reader)
            return Self.startable(&s)
        }
        for job in ready { job.pool.submit(job.run) }
    }

    /// Takes the parts that may start now off the queue. Parts still waiting after that mean
    /// the slots are all busy: the epoch is saturated (`TransferPlan.noteWaiting`).
    private static func startable(_ s: inout State) -> [Job] {
        var ready: [Job] = []
        while s.queue.running < s.plan.parts, s.queue.waiting > 0 {
            if s.queue.running == 0 { s.plan.startedAfterIdle(now: monotonicNow()) }
            guard let next = s.queue.next() else { break }
            ready.append(next.job)
        }
        if s.queue.waiting > 0 { s.plan.noteWaiting() }
        return ready
    }

    /// A slot is given back: the part moved `bytes` in `seconds` (first byte after
    /// `firstByte`), or failed (`refused`: the server asked for fewer requests).
    func release(for reader: ReaderID, bytes: Int64, seconds: Double, firstByte: Double,
                 failed: Bool = false, refused: Bool = false) {
        let now = monotonicNow()
        let ready = state.withLock { s -> [Job] in
            s.queue.finished(for: reader)
            if refused {
                s.plan.refused(now: now)
            } else if !failed {
                s.plan.completed(bytes: bytes, seconds: seconds, firstByte: firstByte, now: now)
            }
            return Self.startable(&s)
        }
        for job in ready { job.pool.submit(job.run) }
    }
}

/// Who asks for read-ahead: one sequential stream (`ReadStreams`) of one open file. Slots are
/// shared between them (`PartQueue`), so four streams in one file get four shares, as four
/// files would.
struct ReaderID: Hashable, Sendable {
    let file: ObjectIdentifier
    let stream: Int
}

