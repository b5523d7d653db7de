/// Per-open-file detection of sequential reading and the size of the read-ahead window.
///
/// A read that starts where the previous one ended (or, for a large read, near it) extends a streak. Once a streak is
/// established (two sequential reads, or one large one — the kernel's own readahead sends
/// 128 KiB to 1 MiB requests for sequential buffered reads) the window opens at one part and,
/// once the streak has read `evidence` bytes, grows fourfold on every read up to `read_ahead`.
/// Anything else resets it: random access gets no read-ahead at all, only the blocks it asked for.
struct Prefetcher {
    let minWindow: Int64
    let maxWindow: Int64
    /// How far a read may start from the previous end and still count as sequential: the
    /// kernel issues several readahead requests at once and they can arrive out of order.
    static let tolerance: Int64 = 4 << 20
    static let largeRead = 128 << 10
    /// What a streak must have read before its window grows past the first: the kernel's own
    /// readahead of one short read is several growing reads (`head -c 100000`: 32, 128 and
    /// 256 KiB), not yet a stream, and a window grown ×4 on each fetched 8 MiB for it. A stream
    /// read by 1 MiB requests (`dd bs=1M`, `cp`'s readahead by its third) grows as before.
    static let evidence: Int64 = 1 << 20

    /// Where the next sequential read would start; none before the first read.
    private var expected: Int64 = Int64.min / 2
    private var streak = 0
    /// Where the current streak began.
    private var streakStart: Int64 = 0
    private var window: Int64
    private var scheduledUntil: Int64 = 0
    /// Whether the last read continued a stream (read-ahead applies), and how far the cache
    /// file has been asked into memory ahead of it (`warm`).
    private var sequential = false
    private var warmedUntil: Int64 = 0

    init(minWindow: Int64, maxWindow: Int64) {
        self.minWindow = min(minWindow, maxWindow)
        self.maxWindow = maxWindow
        window = self.minWindow
    }

    /// Records a read of `count` bytes at `offset`; returns the byte range to fetch ahead, if any.
    /// `limit` caps the window now (the parts that may run at once, `TransferPlan`), and
    /// `granularity` is the least worth scheduling (a part) once the window is wider.
    mutating func observe(offset: Int64, count: Int, size: Int64, limit: Int64? = nil, granularity: Int64? = nil) -> Range<Int64>? {
        let cap = max(minWindow, min(maxWindow, limit ?? maxWindow))
        let end = offset + Int64(count)
        // Exactly where the last read ended, or close to it for the large requests of kernel
        // readahead (which can arrive slightly out of order). Small reads that merely land
        // nearby are random access in a small file, not a stream.
        let near = offset == expected || (count >= Self.largeRead && abs(offset - expected) <= Self.tolerance)
        let startOfFile = offset == 0 && expected == Int64.min / 2
        expected = max(expected, end)
        if !near && !startOfFile {
            streak = 0
            window = minWindow
            expected = end
            scheduledUntil = end
            warmedUntil = end
            streakStart = offset
            sequential = false
            return nil
        }
        streak += 1
        sequential = maxWindow > 0 && (streak >= 2 || count >= Self.largeRead)
        guard sequential else { return nil }
        // ×4 per read: on a far link each read waits a round trip, so the window must reach
        // the link's bandwidth-delay product in a few reads; a short read (head -c) stays small.
        window = streak > 2 && hasEvidence ? min(window * 4, cap) : min(window, cap)
        let from = max(scheduledUntil, end)
        var to = min(size, end + window)
        // Whole parts only: sliding the window by each 1 MiB read would make 1 MiB GETs. And
        // a window that ends short of the file ends on a whole part from where it starts: its
        // last piece would be a short GET that waits for a first byte as long as a full part.
        let least = max(minWindow, min(granularity ?? minWindow, window / 2))
        guard to > from, to - from >= least || to == size else { return nil }
        let unit = max(1, granularity ?? minWindow)
        if to < size, to - from > unit { to = from + (to - from) / unit * unit }
        scheduledUntil = to
        return from..<to
    }

    /// The bytes of the file to ask the kernel to read from the cache file now, after the read
    /// `observe` just saw: those from where the last such ask ended up to `reach` past the
    /// read's end, while the reads continue a stream. Cached bytes are a local disk read away,
    /// so they are asked for a short distance ahead, not across the whole download window: a
    /// reader that stops (`head`, one of several readers of slices of one file) leaves at most
    /// `reach` read from the disk for nothing (docs/architecture.md, "Cached runs ahead").
    mutating func warm(reach: Int64, size: Int64) -> Range<Int64>? {
        guard sequential else { return nil }
        let from = max(warmedUntil, expected)
        let to = min(size, expected + reach)
        guard to > from else { return nil }
        warmedUntil = to
        return from..<to
    }

    /// Whether a read at `offset` of `count` bytes would continue this stream: it starts where
    /// the last read ended, or near it for the kernel's large readahead requests.
    func continues(offset: Int64, count: Int) -> Bool {
        offset == expected || (count >= Self.largeRead && abs(offset - expected) <= Self.tolerance)
    }

    /// How far a read at `offset` is from where this stream goes on.
    func distance(to offset: Int64) -> Int64 { abs(offset - expected) }

    /// No read was observed yet.
    var isFresh: Bool { expected == Int64.min / 2 }

    /// The streak has read enough to be taken for a stream: its window may grow.
    var hasEvidence: Bool { streak > 0 && expected - streakStart >= Self.evidence }

    /// The window from `offset` on could not be scheduled (memory budget): offer it again.
    mutating func unscheduled(from offset: Int64) {
        scheduledUntil = min(scheduledUntil, offset)
    }
}

/// The sequential streams read through one open file, each with a read-ahead window of its own
/// (`Prefetcher`): threads that read disjoint parts of one file through one descriptor (page
/// faults of an `mmap`, `pread` loops over slices) are one open file to the kernel and to
/// storefs, and one window between them was reset by every read of another thread, so four
/// such readers read slower than one (issue 48; docs/architecture.md, "Read-ahead").
///
/// A read continues the stream it follows on from (the nearest, where several could), or starts
/// a new one, which takes the place of the least recently used past `capacity`. One reader
/// alone keeps one stream, as before; random reads each start a stream that gets no window
/// (a fresh stream opens one only on the read that continues it, or a read at 0).
struct ReadStreams {
    struct Stream {
        let id: Int
        var prefetcher: Prefetcher
        var lastUse: Int
    }

    let minWindow: Int64
    let maxWindow: Int64
    let capacity: Int
    private(set) var streams: [Stream] = []
    private var nextID = 0
    private var clock = 0

    init(minWindow: Int64, maxWindow: Int64, capacity: Int = 8) {
        self.minWindow = minWindow
        self.maxWindow = maxWindow
        self.capacity = max(1, capacity)
    }

    /// The stream a read at `offset` of `count` bytes belongs to: one it continues, else a new one.
    mutating func stream(for offset: Int64, count: Int) -> Int {
        clock += 1
        var best: Int? = nil
        for (i, s) in streams.enumerated() where s.prefetcher.continues(offset: offset, count: count) {
            if let b = best, streams[b].prefetcher.distance(to: offset) <= s.prefetcher.distance(to: offset) { continue }
            best = i
        }
        if best == nil, offset == 0, let fresh = streams.firstIndex(where: { $0.prefetcher.isFresh }) { best = fresh }
        if let best {
            streams[best].lastUse = clock
            return streams[best].id
        }
        if streams.count >= capacity, let oldest = streams.indices.min(by: { streams[$0].lastUse < streams[$1].lastUse }) {
            streams.remove(at: oldest)
        }
        let id = nextID
        nextID += 1
        streams.append(Stream(id: id, prefetcher: Prefetcher(minWindow: minWindow, maxWindow: maxWindow), lastUse: clock))
        return id
    }

    /// Runs `body` on stream `id`'s prefetcher; nil if that stream has given its place away.
    mutating func with<T>(_ id: Int, _ body: (inout Prefetcher) -> T) -> T? {
        guard let i = streams.firstIndex(where: { $0.id == id }) else { return nil }
        return body(&streams[i].prefetcher)
    }
}

