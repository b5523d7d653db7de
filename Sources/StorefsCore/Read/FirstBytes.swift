import Foundation
import StorageClient
import Synchronization
import Locking

/// The first bytes of objects, fetched beside their lookup before their generation is known,
/// until the first read of that generation takes them (docs/architecture.md, "Lookups in one
/// round trip"). Where listings carry no sizes (Firebase v0) a lookup costs a metadata GET,
/// and a `head`/`cat` then waits a second round trip for its first read; asked at once, both
/// answers come in one.
///
/// Bounded: at most `capacity` entries of at most `length` bytes, each forgotten `lifetime`
/// seconds after it was asked for whether or not a read took it. The bytes are used only if
/// the answer's generation and size are the ones the reader opened; they then go through the
/// read path like any download's (stored, checked with the rest of the object).
final class FirstBytesTable: Sendable {
    static let length = 128 << 10
    static let capacity = 32
    static let lifetime = 5.0

    /// What the GET brought: nil if it failed (a directory, a missing name, a refusal).
    struct Landed: Sendable {
        var generation: Int64
        var size: Int64?
        var bytes: [UInt8]
    }

    final class Entry: Sendable {
        let asked: Double
        private let outcome = OrderedMutex<Landed??>(.firstBytesEntry, nil)
        private let group = DispatchGroup()

        init(asked: Double) {
            self.asked = asked
            group.enter()
        }

        func finish(_ landed: Landed?) {
            outcome.withLock { $0 = .some(landed) }
            group.leave()
        }

        /// The outcome, waiting for it at most until `deadline` (monotonic seconds) or until
        /// `isCancelled`; nil if it has not come by then or failed.
        func wait(until deadline: Double, isCancelled: (@Sendable () -> Bool)?) -> Landed? {
            while true {
                if let o = outcome.withLock({ $0 }) { return o }
                let left = deadline - monotonicNow()
                if left <= 0 || isCancelled?() == true { return nil }
                _ = group.wait(timeout: .now() + min(left, 0.05))
            }
        }
    }

    private let entries = OrderedMutex(.firstBytesTable, [ByteName: Entry]())
    private let count = Atomic<Int>(0)

    /// A new entry for `name`, or nil when one is already there or the table is full.
    func begin(_ name: String, now: Double = monotonicNow()) -> Entry? {
        entries.withLock { e -> Entry? in
            e = e.filter { now - $0.value.asked < Self.lifetime }
            defer { count.store(e.count, ordering: .relaxed) }
            let key = ByteName(name)
            guard e[key] == nil, e.count < Self.capacity else { return nil }
            let entry = Entry(asked: now)
            e[key] = entry
            return entry
        }
    }

    /// The first bytes of generation `generation` (of `size` bytes) of `name`, if they were
    /// asked for: waits for their answer (at most `wait` seconds, or until `isCancelled`) and
    /// takes the entry. Exactly `min(length, size)` bytes, or nil.
    func take(_ name: String, generation: Int64, size: Int64, wait: Double,
              isCancelled: (@Sendable () -> Bool)?) -> [UInt8]? {
        guard count.load(ordering: .relaxed) > 0 else { return nil }
        let now = monotonicNow()
        guard let entry = entries.withLock({ e -> Entry? in
            let entry = e.removeValue(forKey: ByteName(name))
            count.store(e.count, ordering: .relaxed)
            return entry
        }), now - entry.asked < Self.lifetime else { return nil }
        guard let landed = entry.wait(until: now + wait, isCancelled: isCancelled),
              landed.generation == generation, landed.size.map({ $0 == size }) ?? true,
              Int64(landed.bytes.count) == min(Int64(Self.length), size) else { return nil }
        return landed.bytes
    }

    var isEmpty: Bool { count.load(ordering: .relaxed) == 0 }

    /// Whether `name`'s first bytes were asked for (and not taken yet).
    func contains(_ name: String) -> Bool {
        !isEmpty && entries.withLock { $0[ByteName(name)] != nil }
    }
}

extension BlockReader {
    /// Whether the cache holds any bytes of that generation of `name`.
    func hasCachedBytes(of name: String, generation: Int64, size: Int64) -> Bool {
        (cache?.cachedBytes(endpoint: endpoint, bucket: store.bucket, name: name, generation: generation, size: size) ?? 0) > 0
    }

    /// Asks for the first bytes of `name` (whatever its generation) on a thread `submit` gives,
    /// for a lookup that needs a round trip anyway (docs/architecture.md, "Lookups in one round
    /// trip"): the file's first read then waits for this answer instead of asking again.
    public func fetchFirstBytes(of name: String, submit: (@escaping @Sendable () -> Void) -> Void) {
        guard let entry = firstBytes.begin(name) else { return }
        submit { [store] in
            var bytes = [UInt8](repeating: 0, count: FirstBytesTable.length)
            let start = try? bytes.withUnsafeMutableBytes { (b) throws(StorageError) -> ObjectStart? in
                try store.readStart(name, into: b, isCancelled: nil)
            }
            entry.finish(start.flatMap { $0 }.map { FirstBytesTable.Landed(generation: $0.generation, size: $0.size,
                                                                            bytes: Array(bytes.prefix($0.count))) })
        }
    }
}
