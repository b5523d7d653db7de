import Testing
@testable import StorefsCore

/// `TransferPlan` against a simulated link: every part waits `ttfb`, then moves at
/// min(`perConnection`, `aggregate` / parts moving) bytes per second. The reader always wants
/// more (unless `demand` caps the parts it keeps asked for). `costPerPart` models a link whose
/// pace is the daemon's CPU (loopback): each part moving takes that fraction off the aggregate.
/// `jitter` spreads each part's wait over `ttfb` × (1 ± jitter) (a fixed sequence): without it
/// parts that start together wait and move in lockstep for ever, the link idle during every
/// wait, which a reader's window (parts asked for as it reads on) and a real server do not do.
@Suite struct TransferPlanTests {
    static let mib = Double(1 << 20)

    struct Outcome {
        var plan: TransferPlan
        /// Bytes per second over the last second simulated.
        var lastSecondRate: Double
        var mostParts: Int
    }

    func simulate(_ limits: TransferPlan.Limits, perConnection: Double, aggregate: Double, ttfb: Double,
                  seconds: Double = 6, demand: Int = .max, costPerPart: Double = 0, jitter: Double = 0) -> Outcome {
        var plan = TransferPlan(limits: limits, now: 0)
        var seed: UInt64 = 0x9E37_79B9_7F4A_7C15
        func wait() -> Double {
            seed = seed &* 6_364_136_223_846_793_005 &+ 1_442_695_040_888_963_407
            return ttfb * (1 + jitter * (Double(seed >> 11) / Double(1 << 53) * 2 - 1))
        }
        struct Part { var started: Double; var waiting: Double; var left: Double; let size: Int64; var firstByte = 0.0 }
        var running: [Part] = []
        let dt = 0.0005
        var t = 0.0
        var lateBytes = 0.0
        var most = 0
        while t < seconds {
            // Start what the plan allows while the reader wants more.
            while running.count < min(plan.parts, demand) {
                running.append(Part(started: t, waiting: wait(), left: Double(plan.partSize), size: plan.partSize))
            }
            if running.count == plan.parts && demand > plan.parts {
                plan.noteWaiting()
                plan.noteReaderWaited()
            }
            most = max(most, running.count)
            let moving = running.filter { $0.waiting <= 0 }.count
            let total = aggregate * max(0.1, 1 - costPerPart * Double(moving))
            let rate = moving == 0 ? 0 : min(perConnection, total / Double(moving))
            t += dt
            var done: [Part] = []
            for i in running.indices {
                if running[i].waiting > 0 {
                    running[i].waiting -= dt
                    if running[i].waiting <= 0 { running[i].firstByte = t - running[i].started }
                    continue
                }
                let moved = min(running[i].left, rate * dt)
                running[i].left -= moved
                if t > seconds - 1 { lateBytes += moved }
                if running[i].left <= 0 { done.append(running[i]) }
            }
            running.removeAll { $0.left <= 0 }
            for p in done { plan.completed(bytes: p.size, seconds: t - p.started, firstByte: p.firstByte, now: t) }
        }
        return Outcome(plan: plan, lastSecondRate: lateBytes, mostParts: most)
    }

    /// One epoch's parts, all started together at `t` and sharing `rate`: each 8 MiB part takes
    /// parts × 8 MiB / rate seconds (30 ms of it to the first byte).
    static func wave(_ plan: inout TransferPlan, _ t: inout Double, rate: Double) {
        let part: Int64 = 8 << 20
        let n = plan.parts
        let start = t
        let seconds = Double(n) * Double(part) / rate
        for i in 0..<n {
            plan.noteWaiting()
            plan.noteReaderWaited()
            t = start + seconds + Double(i) * 1e-6
            plan.completed(bytes: part, seconds: t - start, firstByte: 0.03, now: t)
        }
    }

    /// bench/run --link wan: 30 ms to the first byte, 50 MiB/s a connection, 1 GiB/s in all.
    /// Sixteen parallel ranged streams get ~650 MiB/s there: the plan must find as much. Its
    /// parts stay 2 MiB, though 30 ms is over a third of such a part's time: the bytes that fill
    /// a link are its rate × (first byte + part ÷ a connection's rate), least for small parts,
    /// so more parts, not larger ones, are what pays within memory. Parts of 4 MiB (the start
    /// before, up to 32 of them) held 72 MiB in flight here for ~600 MiB/s.
    @Test func aWanLinkIsFilledByMorePartsNotLargerOnes() {
        // The whole link carries what 16 curl streams got through the proxy on this machine.
        let o = simulate(.init(), perConnection: 50 * Self.mib, aggregate: 650 * Self.mib, ttfb: 0.030, jitter: 0.3)
        #expect(o.plan.parts >= 16 && o.plan.parts <= 48, "parts \(o.plan.parts)")
        #expect(o.plan.partSize == 2 << 20, "parts of \(o.plan.partSize >> 20) MiB")
        #expect(Int64(o.plan.parts) * o.plan.partSize <= 64 << 20, "\(o.plan.parts) parts in flight")
        #expect(o.lastSecondRate >= 0.9 * 650 * Self.mib, "rate \(o.lastSecondRate / Self.mib) MiB/s")
    }

    /// bench/run --link harsh: 80 ms, 20 MiB/s a connection. A 2 MiB part waits for its first
    /// byte 80 of its 180 ms: the count grows past 32 (the ceiling before, where 4 MiB parts
    /// held 128 MiB) and the parts stay 2 MiB, at most 96 MiB in flight.
    @Test func aHarshLinkIsFilled() {
        let o = simulate(.init(), perConnection: 20 * Self.mib, aggregate: 1024 * Self.mib, ttfb: 0.080, seconds: 10, jitter: 0.3)
        #expect(o.mostParts > 32, "parts \(o.mostParts)")
        #expect(o.plan.partSize == 2 << 20, "parts of \(o.plan.partSize >> 20) MiB")
        #expect(o.lastSecondRate >= 0.8 * 16 * 20 * Self.mib, "rate \(o.lastSecondRate / Self.mib) MiB/s")
    }

    /// One fast connection carries everything: more parts bring nothing, so they stop.
    @Test func growthStopsWhenThroughputStops() {
        let o = simulate(.init(), perConnection: 400 * Self.mib, aggregate: 400 * Self.mib, ttfb: 0.0005)
        #expect(o.plan.parts <= 10, "parts \(o.plan.parts)")
        #expect(o.plan.best.map { $0.parts <= 8 } == true)
        #expect(o.lastSecondRate >= 0.95 * 400 * Self.mib)
    }

    /// The daemon's CPU sets the pace, and every part in flight costs a little of it (memory
    /// touched, buffers copied). Sixteen parts to start with are too many: the count steps down
    /// to the few that still move as much, and throughput stays near the best.
    @Test func whereTheCpuSetsThePaceFewerPartsWin() {
        let o = simulate(.init(startParts: 16, startPartSize: 8 << 20), perConnection: 300 * Self.mib, aggregate: 1200 * Self.mib,
                         ttfb: 0.004, seconds: 3, costPerPart: 0.01)
        #expect(o.plan.parts <= 6, "parts \(o.plan.parts)")
        // Within a few percent of what the sixteen it started with moved (1200 × (1 − 0.16)),
        // probes included.
        #expect(o.lastSecondRate >= 0.8 * 1200 * Self.mib, "rate \(o.lastSecondRate / Self.mib) MiB/s")
    }

    /// Loopback: the first byte comes within 3 ms, so the count starts at 4, not 16, parts are
    /// 2 MiB, not 8, and however much more parts seem to pay, at most 8 run at once.
    @Test func aNearServerStartsWithFewSmallParts() {
        let limits = TransferPlan.Limits(startParts: 16)
        var plan = TransferPlan(limits: limits, now: 0)
        #expect(plan.parts == 16 && plan.partSize == limits.startPartSize)
        plan.noteWaiting()
        plan.completed(bytes: 2 << 20, seconds: 0.002, firstByte: 0.0003, now: 0.01)
        #expect(plan.parts == 4 && plan.partSize == limits.nearPartSize)
        let o = simulate(limits, perConnection: 1200 * Self.mib, aggregate: 1200 * Self.mib, ttfb: 0.0002, seconds: 3)
        #expect(o.plan.parts <= 5 && o.plan.partSize == 2 << 20, "parts \(o.plan.parts) of \(o.plan.partSize)")
        #expect(o.lastSecondRate >= 0.8 * 1200 * Self.mib, "rate \(o.lastSecondRate / Self.mib) MiB/s")
        // Where every part more seems to pay (a first byte of 2 ms is a large share of a
        // 2 MiB part on a fast link), the count stops at 8.
        let o2 = simulate(limits, perConnection: 400 * Self.mib, aggregate: 4000 * Self.mib, ttfb: 0.0025, seconds: 3)
        #expect(o2.plan.parts <= limits.nearMaxParts, "parts \(o2.plan.parts)")
        // A far server keeps the sixteen, and their size.
        var far = TransferPlan(limits: limits, now: 0)
        far.completed(bytes: 2 << 20, seconds: 0.07, firstByte: 0.030, now: 0.07)
        #expect(far.parts == 16 && far.partSize == limits.startPartSize)
    }

    /// A busy machine made the first download slow (8 readers starting at once on loopback):
    /// the server was judged far and the count stayed at 16 parts of 4 MiB. The next first
    /// byte within 3 ms finds it near after all; a slow one after that changes nothing.
    @Test func aSlowFirstAnswerFromANearServerIsCorrectedByTheNext() {
        let limits = TransferPlan.Limits(startParts: 16)
        var plan = TransferPlan(limits: limits, now: 0)
        plan.noteWaiting()
        plan.completed(bytes: 2 << 20, seconds: 0.02, firstByte: 0.012, now: 0.02)
        #expect(!plan.isNear && plan.parts == 16 && plan.partSize == limits.startPartSize)
        plan.completed(bytes: 8 << 20, seconds: 0.01, firstByte: 0.0004, now: 0.03)
        #expect(plan.isNear && plan.parts == limits.nearStartParts && plan.partSize == limits.nearPartSize)
        plan.completed(bytes: 2 << 20, seconds: 0.05, firstByte: 0.040, now: 0.08)
        #expect(plan.isNear && plan.parts <= limits.nearMaxParts && plan.partSize == limits.nearPartSize)
    }

    /// An answer to a lookup within 3 ms judges the server near before any download, so the
    /// readers' first windows are planned near; a slow one leaves the judgment to the first
    /// download (a server may take longer over metadata than over bytes).
    @Test func aFastLookupJudgesTheServerNearASlowOneLeavesItToTheDownloads() {
        let limits = TransferPlan.Limits(startParts: 16)
        var near = TransferPlan(limits: limits, now: 0)
        near.noteAnswer(seconds: 0.0005)
        #expect(near.isNear && near.startJudged && near.parts == limits.nearStartParts && near.partSize == limits.nearPartSize)
        near.completed(bytes: 2 << 20, seconds: 0.05, firstByte: 0.012, now: 0.05)
        #expect(near.isNear)

        var undecided = TransferPlan(limits: limits, now: 0)
        undecided.noteAnswer(seconds: 0.030)
        #expect(!undecided.startJudged && undecided.parts == 16 && undecided.partSize == limits.startPartSize)
        undecided.completed(bytes: 2 << 20, seconds: 0.07, firstByte: 0.030, now: 0.07)
        #expect(undecided.startJudged && !undecided.isNear && undecided.parts == 16)
    }

    /// The read-ahead keeps ahead of its reader (a reader slower than the link, or the daemon's
    /// own copies setting the pace): no reader waits for a part, so the count steps down to
    /// the fewest parts, whatever the throughput says, and is probed upward again once readers wait.
    @Test func aReaderKeptAheadOfNeedsFewParts() {
        var plan = TransferPlan(limits: .init(startParts: 16), now: 0)
        let part: Int64 = 8 << 20
        var t = 0.0
        func epoch(readerWaited: Bool) {
            for _ in 0..<max(2, plan.parts) {
                plan.noteWaiting()
                if readerWaited { plan.noteReaderWaited() }
                t += 0.07
                plan.completed(bytes: part, seconds: 0.02, firstByte: 0.0001, now: t)
            }
        }
        for _ in 0..<12 { epoch(readerWaited: false) }
        #expect(plan.parts == 2, "parts \(plan.parts)")
        epoch(readerWaited: true)  // a reader waits: the count is probed upward again
        #expect(plan.parts == 3, "parts \(plan.parts)")
    }

    /// A step down that costs throughput is undone: a wan link keeps the parts that fill it.
    @Test func aStepDownThatLosesIsUndone() {
        // Parts of 8 MiB (what `wave` moves), so 192 MiB holds 24.
        var plan = TransferPlan(limits: .init(startParts: 16, startPartSize: 8 << 20, memoryLimit: 192 << 20), now: 0)
        var t = 0.0
        func epoch(_ rate: Double) { Self.wave(&plan, &t, rate: rate) }
        epoch(600 * Self.mib)  // 16
        #expect(plan.parts == 24)
        epoch(800 * Self.mib)  // 24 pays; at the memory ceiling, so 18 is tried
        #expect(plan.parts == 18)
        epoch(650 * Self.mib)  // 18 loses
        #expect(plan.parts == 24)
        for _ in 0..<5 { epoch(800 * Self.mib) }
        #expect(plan.parts == 24)
    }

    /// Waiting for the first byte takes most of an 8 MiB part's time on a fast, far link, and
    /// the count is at its ceiling (`parallel=8`): parts grow instead (within memory).
    @Test func partsGrowWhereTheFirstByteDominates() {
        var limits = TransferPlan.Limits()
        limits.maxParts = 8
        let o = simulate(limits, perConnection: 1024 * Self.mib, aggregate: 2048 * Self.mib, ttfb: 0.040)
        #expect(o.plan.partSize >= 16 << 20, "parts \(o.plan.parts) size \(o.plan.partSize)")
        #expect(Int64(o.plan.parts) * o.plan.partSize <= 256 << 20)
    }

    /// Near the server a slow first byte is the machine's load, not distance (8 readers and the
    /// server on 2 cores: 3–15 ms): parts stay 2 MiB where a far server's would grow.
    @Test func nearTheServerPartsDoNotGrowWhateverTheFirstByte() {
        var limits = TransferPlan.Limits(startParts: 8)
        limits.maxParts = 8
        // Every part waits 10 ms for a first byte that a 2 MiB part then takes 5 ms to follow.
        func answerEveryPart(_ plan: inout TransferPlan) {
            var t = 0.0
            for _ in 0..<200 {
                for _ in 0..<plan.parts {
                    plan.noteWaiting()
                    plan.noteReaderWaited()
                    t += 0.015 / Double(plan.parts)
                    plan.completed(bytes: plan.partSize, seconds: 0.015, firstByte: 0.010, now: t)
                }
            }
        }
        var plan = TransferPlan(limits: limits, now: 0)
        plan.noteAnswer(seconds: 0.0005)
        #expect(plan.isNear && plan.partSize == limits.nearPartSize)
        answerEveryPart(&plan)
        #expect(plan.partSize == limits.nearPartSize, "parts grew to \(plan.partSize >> 20) MiB")
        // The same answers from a far server (the count at its ceiling) grow them.
        var far = TransferPlan(limits: limits, now: 0)
        answerEveryPart(&far)
        #expect(!far.isNear && far.partSize > 8 << 20, "far parts \(far.partSize >> 20) MiB")
    }

    /// A far, fast link: the count grows to its ceiling (48) first (more parts beat larger
    /// ones), and there, the first byte still most of a part's time, parts grow only while
    /// twice the bytes in flight fit in half of what parts may hold: on the defaults (a 256 MiB
    /// bound) they stay 2 MiB, where the rule before grew them to 4 MiB (192 MiB in flight);
    /// with a bound of 1 GiB (`memory_limit=` raised for such a link) they grow to 8 MiB.
    @Test func theCountReachesItsCeilingBeforePartsGrow() {
        let o = simulate(.init(), perConnection: 1024 * Self.mib, aggregate: 2048 * Self.mib, ttfb: 0.040)
        #expect(o.mostParts == 48 && o.plan.partSize == 2 << 20, "parts \(o.plan.parts) size \(o.plan.partSize)")
        var roomy = TransferPlan.Limits()
        roomy.memoryLimit = 1 << 30
        let r = simulate(roomy, perConnection: 1024 * Self.mib, aggregate: 2048 * Self.mib, ttfb: 0.040)
        #expect(r.mostParts == 48 && r.plan.partSize == 8 << 20, "parts \(r.plan.parts) size \(r.plan.partSize)")
        #expect(Int64(r.plan.parts) * r.plan.partSize <= 512 << 20)
    }

    /// A stream's first parts are small (its window is still opening), so most of their time
    /// is the wait for the first byte: that must not make full parts grow on a wan link.
    @Test func smallFirstPartsDoNotGrowParts() {
        var plan = TransferPlan(limits: .init(), now: 0)
        var t = 0.0
        for size in [1, 1, 2, 2, 4, 4, 8, 8] as [Int64] {
            plan.noteWaiting()
            plan.noteReaderWaited()
            let seconds = 0.030 + Double(size << 20) / (50 * Self.mib)
            t += 0.06
            plan.completed(bytes: size << 20, seconds: seconds, firstByte: 0.030, now: t)
        }
        #expect(plan.partSize == TransferPlan.Limits().startPartSize)
    }

    /// The first part starts long after the plan was made (a mount idle for 10 s): that wait
    /// is not a slow link. A step from 16 to 24 parts that brings nothing is undone (and as
    /// the link moves as much with fewer, fewer are tried next).
    @Test func anIdleGapIsNotASlowLink() {
        var plan = TransferPlan(limits: .init(startParts: 16, startPartSize: 8 << 20, memoryLimit: 192 << 20), now: 0)
        var t = 10.0
        plan.startedAfterIdle(now: t)
        for count in [16, 24] {
            #expect(plan.parts == count)
            Self.wave(&plan, &t, rate: 800 * Self.mib)  // the link's whole speed, however many parts share it
        }
        #expect(plan.parts <= 16, "parts \(plan.parts)")
    }

    @Test func aReaderThatAsksForLittleGrowsNothing() {
        let o = simulate(.init(), perConnection: 50 * Self.mib, aggregate: 1024 * Self.mib, ttfb: 0.030, demand: 2)
        #expect(o.plan.parts == 8 && o.mostParts == 2)
    }

    @Test func memoryAndCeilingBoundTheCount() {
        var limits = TransferPlan.Limits()
        limits.memoryLimit = 64 << 20
        let o = simulate(limits, perConnection: 10 * Self.mib, aggregate: 1024 * Self.mib, ttfb: 0.030)
        #expect(o.mostParts <= 32 && o.plan.parts <= 32)  // 64 MiB holds 32 parts of 2 MiB
        limits = TransferPlan.Limits()
        limits.maxParts = 12
        let c = simulate(limits, perConnection: 10 * Self.mib, aggregate: 1024 * Self.mib, ttfb: 0.030)
        #expect(c.mostParts <= 12 && c.plan.parts == 12)
    }

    @Test func aFixedCountNeverMoves() {
        var limits = TransferPlan.Limits()
        limits.fixedParts = 4
        limits.maxPartSize = limits.startPartSize
        let o = simulate(limits, perConnection: 50 * Self.mib, aggregate: 1024 * Self.mib, ttfb: 0.030)
        #expect(o.plan.parts == 4 && o.mostParts == 4 && o.plan.partSize == limits.startPartSize)
    }

    @Test func refusalsHalveTheCountAndItHolds() {
        var plan = TransferPlan(limits: .init(), now: 0)
        #expect(plan.parts == 8)
        plan.refused(now: 1)
        #expect(plan.parts == 4)
        plan.refused(now: 2)
        plan.refused(now: 3)
        #expect(plan.parts == 2)
    }
}
