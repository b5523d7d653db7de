import Foundation
import Locking

/// Runs a blocking function over many inputs, at most `width` at a time, on threads of our
/// own (never Swift's two-thread cooperative pool): for the per-item metadata GETs of a v0 listing.
enum ParallelMap {
    /// Shared by every call: at most this many items run at once over all calls (metadata
    /// workers sizing v0 listings side by side), and its threads end once idle, where a thread
    /// per item and call was started before (issue 49, item 4).
    static let threads = 64
    static let pool = WorkerPool(threads: 1, name: "storefs-sizes", maxThreads: threads)

    static func run<T: Sendable, R: Sendable>(_ inputs: [T], width: Int, _ body: @escaping @Sendable (T) -> R) -> [R] {
        if inputs.isEmpty { return [] }
        let results = ResultSlots<R>(count: inputs.count)
        let group = DispatchGroup()
        let box = IndexBox(count: inputs.count)
        for _ in 0..<min(max(1, width), inputs.count) {
            group.enter()
            pool.submit {
                while let i = box.claim() { results.set(i, body(inputs[i])) }
                group.leave()
            }
        }
        group.wait()
        return results.values
    }

    private final class IndexBox: @unchecked Sendable {
        private let lock = OrderedLock(.parallelMap)
        private var next = 0
        private let count: Int
        init(count: Int) { self.count = count }
        func claim() -> Int? {
            lock.lock()
            defer { lock.unlock() }
            guard next < count else { return nil }
            next += 1
            return next - 1
        }
    }

    private final class ResultSlots<R>: @unchecked Sendable {
        private let lock = OrderedLock(.parallelMap)
        private var slots: [R?]
        init(count: Int) { slots = Array(repeating: nil, count: count) }
        func set(_ i: Int, _ v: R) { lock.lock(); slots[i] = v; lock.unlock() }
        var values: [R] { lock.lock(); defer { lock.unlock() }; return slots.map { $0! } }
    }
}
