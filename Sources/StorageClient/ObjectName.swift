/// Percent-encoding of bucket and object names (docs/protocol.md §1.3, §8).
///
/// One rule for both protocols, for paths and query values alike: every byte outside
/// `A–Z a–z 0–9 - . _ ~` is written as `%XX` (uppercase hex) of its UTF-8 encoding.
public enum ObjectName {
    private static let hex: [UInt8] = Array("0123456789ABCDEF".utf8)

    @inline(__always)
    private static func isUnreserved(_ b: UInt8) -> Bool {
        switch b {
        case UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "a")...UInt8(ascii: "z"),
             UInt8(ascii: "0")...UInt8(ascii: "9"),
             UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"), UInt8(ascii: "~"):
            return true
        default:
            return false
        }
    }

    /// Encodes `s` as one URL path segment or query value (`/` becomes `%2F`).
    public static func encode(_ s: String) -> String { encode(s, keepingSlash: false) }

    /// Encodes `s` keeping `/` literal (XML-style public URLs such as `storage.googleapis.com/B/a/b`).
    public static func encode(_ s: String, keepingSlash: Bool) -> String {
        var out: [UInt8] = []
        out.reserveCapacity(s.utf8.count)
        for b in s.utf8 {
            if isUnreserved(b) || (keepingSlash && b == UInt8(ascii: "/")) {
                out.append(b)
            } else {
                out.append(UInt8(ascii: "%"))
                out.append(hex[Int(b >> 4)])
                out.append(hex[Int(b & 0xF)])
            }
        }
        return String(decoding: out, as: UTF8.self)
    }

    /// Decodes `%XX` sequences; returns nil on a malformed escape or invalid UTF-8.
    public static func decode(_ s: String) -> String? {
        var out: [UInt8] = []
        var it = Array(s.utf8)[...]
        while let b = it.popFirst() {
            if b == UInt8(ascii: "%") {
                guard it.count >= 2, let hi = hexValue(it.removeFirst()), let lo = hexValue(it.removeFirst()) else {
                    return nil
                }
                out.append(hi << 4 | lo)
            } else {
                out.append(b)
            }
        }
        return String(validating: out, as: UTF8.self)
    }

    private static func hexValue(_ b: UInt8) -> UInt8? {
        switch b {
        case UInt8(ascii: "0")...UInt8(ascii: "9"): return b - UInt8(ascii: "0")
        case UInt8(ascii: "a")...UInt8(ascii: "f"): return b - UInt8(ascii: "a") + 10
        case UInt8(ascii: "A")...UInt8(ascii: "F"): return b - UInt8(ascii: "A") + 10
        default: return nil
        }
    }

    /// Builds a query string `k=v&…` with both sides encoded by the same rule.
    public static func query(_ items: [(String, String)]) -> String {
        items.map { "\(encode($0.0))=\(encode($0.1))" }.joined(separator: "&")
    }
}
