import Foundation
import Synchronization
import Testing
@testable import StorefsCore

/// The gate's choice of which read-ahead part starts next (`PartQueue`), and the gate itself
/// (`TransferController.enqueue`/`release`) on real threads.
@Suite struct PartQueueTests {
    /// Runs `slots` parts at a time, each finishing in the order it started, until every part
    /// of every reader has run; returns the readers in the order their parts started.
    func drain(_ q: inout PartQueue<String, Int>, slots: Int) -> [String] {
        var order: [String] = []
        var running: [String] = []
        while true {
            while running.count < slots, let next = q.next() {
                order.append(next.reader)
                running.append(next.reader)
            }
            guard !running.isEmpty else { return order }
            q.finished(for: running.removeFirst())
        }
    }

    @Test func readersThatAskAfterAWideWindowStillGetAnEqualShareOfTheSlots() {
        // Reader a's window opened first and queued 26 parts; b, c and d queued theirs after.
        // First come first served would start a's 26 before any of the others'.
        var q = PartQueue<String, Int>()
        for reader in ["a", "b", "c", "d"] {
            for part in 0..<26 { q.add(part, for: reader) }
        }
        let order = drain(&q, slots: 8)
        #expect(order.count == 104)
        let first32 = order.prefix(32)
        for reader in ["a", "b", "c", "d"] {
            #expect(first32.filter { $0 == reader }.count == 8, "\(reader) in the first 32 starts: \(Array(first32))")
        }
    }

    @Test func aFreeSlotGoesToTheReaderWithTheFewestPartsRunning() {
        var q = PartQueue<String, Int>()
        for part in 0..<4 { q.add(part, for: "a") }
        // a has three parts running when b asks.
        for _ in 0..<3 { _ = q.next() }
        q.add(0, for: "b")
        q.add(1, for: "b")
        #expect(q.next()?.reader == "b")
        #expect(q.next()?.reader == "b")
        // Now a runs 3 and b runs 2: b's queue is empty, so a's last part goes.
        #expect(q.next()?.reader == "a")
        #expect(q.next() == nil)
    }

    @Test func partsOfOneReaderStartInTheOrderTheyAsked() {
        var q = PartQueue<String, Int>()
        for part in 0..<3 { q.add(part, for: "a") }
        q.add(100, for: "b")
        for part in 3..<5 { q.add(part, for: "a") }
        var parts: [Int] = []
        while let next = q.next() {
            if next.reader == "a" { parts.append(next.job) }
        }
        #expect(parts == [0, 1, 2, 3, 4])
    }

    @Test func betweenReadersRunningAsManyThePartThatAskedFirstStarts() {
        var q = PartQueue<String, Int>()
        q.add(0, for: "b")
        q.add(0, for: "a")
        q.add(1, for: "b")
        #expect(q.next()?.reader == "b")
        #expect(q.next()?.reader == "a")
        #expect(q.next()?.reader == "b")
    }

    @Test func aReaderThatWantsLessThanItsShareGetsAllItAsks() {
        var q = PartQueue<String, Int>()
        for part in 0..<10 { q.add(part, for: "a") }
        q.add(0, for: "b")
        var started: [String] = []
        for _ in 0..<4 { if let next = q.next() { started.append(next.reader) } }
        #expect(started.filter { $0 == "b" }.count == 1)
        #expect(started.filter { $0 == "a" }.count == 3)
    }

    @Test func aReaderStopsSharingOnceItsLastPartEnds() {
        var q = PartQueue<String, Int>()
        q.add(0, for: "a")
        q.add(0, for: "b")
        #expect(q.readers == 2 && q.waiting == 2)
        _ = q.next()
        _ = q.next()
        #expect(q.running == 2 && q.waiting == 0)
        q.finished(for: "a")
        #expect(q.readers == 1 && !q.isSharing("a") && q.isSharing("b"))
        q.finished(for: "b")
        q.finished(for: "b")  // one finish too many changes nothing
        #expect(q.readers == 0 && q.running == 0)
    }

    @Test func theGateRunsAtMostItsPartsAtOnceAndAlternatesBetweenReaders() throws {
        let controller = TransferController(limits: .init(startParts: 2, minParts: 2, maxParts: 2, fixedParts: 2))
        let pool = WorkerPool(threads: 8, name: "test-gate")
        let a = ReaderID(file: ObjectIdentifier(Int.self), stream: 0), b = ReaderID(file: ObjectIdentifier(String.self), stream: 0)
        let log = Mutex<(running: Int, most: Int, order: [String])>((0, 0, []))
        let done = DispatchSemaphore(value: 0)
        let go = DispatchSemaphore(value: 0)
        // Each part holds its slot until the test lets it go, one at a time.
        func part(_ name: String, _ reader: ReaderID) -> @Sendable () -> Void {
            return {
                log.withLock { l in
                    l.running += 1
                    l.most = max(l.most, l.running)
                    l.order.append(name)
                }
                go.wait()
                log.withLock { $0.running -= 1 }
                controller.release(for: reader, bytes: 1 << 20, seconds: 0.01, firstByte: 0.001)
                done.signal()
            }
        }
        for i in 0..<4 { controller.enqueue(for: a, on: pool, part("a\(i)", a)) }
        for i in 0..<4 { controller.enqueue(for: b, on: pool, part("b\(i)", b)) }
        #expect(controller.sharingReaders(with: a) == 2)
        for _ in 0..<8 {
            Thread.sleep(forTimeInterval: 0.02)
            go.signal()
            #expect(done.wait(timeout: .now() + 10) == .success)
        }
        let l = log.withLock { $0 }
        #expect(l.most <= 2)
        #expect(l.order.count == 8)
        // a's first two had both slots; the first slot freed after b asked went to b, and b's
        // second part started before a's last (first come first served: a0 a1 a2 a3 b0 …).
        #expect(Array(l.order.prefix(2)) == ["a0", "a1"])
        #expect(l.order.firstIndex(of: "b0") == 2, "\(l.order)")
        #expect(l.order.firstIndex(of: "b1")! < l.order.firstIndex(of: "a3")!, "\(l.order)")
        #expect(controller.running == 0)
    }
}
