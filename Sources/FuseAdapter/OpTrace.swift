import Glibc
import StorageClient
import StorefsCore

/// One FUSE operation on its way to a reply: counted in `Metrics` and, at `log_level=debug`,
/// logged as one line (op, inode, name, result, duration) when it is answered
/// (docs/operations.md, "Logs").
final class OpTrace: @unchecked Sendable {
    let op: FuseOp
    let inode: UInt64
    let name: String?
    let started: Double
    /// The result when the reply was a success on the wire but means "no" (a negative entry).
    var result: Int32 = 0

    init(_ op: FuseOp, inode: UInt64, name: String? = nil) {
        self.op = op
        self.inode = inode
        self.name = name
        started = monotonicNow()
    }

    /// The reply went out: `errno` 0 for success.
    func finish(_ errno: Int32 = 0) {
        OpTrace.record(op, inode: inode, name: name, errno: errno != 0 ? errno : result, started: started)
    }

    /// For operations that need no object (reads: no allocation on the hot path).
    static func record(_ op: FuseOp, inode: UInt64, name: String? = nil, errno: Int32, started: Double, bytes: Int = 0) {
        let seconds = monotonicNow() - started
        Metrics.shared.operation(op.rawValue, errno: errno, seconds: seconds, bytes: bytes, isRead: op == .read)
        guard Log.enabled(.debug) else { return }
        var fields = [("op", op.name), ("ino", String(inode))]
        if let name { fields.append(("name", name)) }
        fields.append(("result", Errno.name(errno)))
        if op == .read { fields.append(("bytes", String(bytes))) }
        fields.append(("dur_ms", String(Double(Int(seconds * 1_000_000)) / 1000)))
        Log.log(.debug, "fuse", fields: fields)
    }
}
