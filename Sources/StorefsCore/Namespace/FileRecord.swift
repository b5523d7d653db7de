import Foundation
import StorageClient

/// What the namespace keeps about one file: what `stat` and a read need, and nothing else
/// (48 bytes, no heap). The whole
/// object resource (content type, custom metadata, download tokens) is kept only briefly,
/// for extended attributes (`FullMetadataCache`): a million remembered files must not
/// cost a million object resources (docs/architecture.md, "Metadata memory").
public struct FileRecord: Sendable, Equatable {
    // Stored compactly (48 bytes, no heap; `FileRecordLayoutTests` holds it to that): the
    // properties below are views of these.
    public var size: Int64
    /// Content identity: a new generation is a new object, a new inode, new cache blocks.
    public var generation: Int64
    private var mtimeSeconds: Int64
    private var mtimeNanos: Int32
    private var crcValue: UInt32
    private var uidValue: UInt32
    private var gidValue: UInt32
    private var modeValue: UInt16
    /// A legacy symlink's target length (its `stat` size; the object itself is empty).
    public var metadataTargetLength: UInt16 = 0
    private var symlinkValue: UInt8
    private var hasCRC: Bool

    /// What `stat` shows (`ObjectMetadata.modificationTime`).
    public var modified: Timestamp {
        get { Timestamp(seconds: mtimeSeconds, nanoseconds: mtimeNanos) }
        set { mtimeSeconds = newValue.seconds; mtimeNanos = newValue.nanoseconds }
    }

    /// base64 crc32c of the whole object, when the server gave one (end-to-end checks).
    public var crc32c: String? {
        get {
            guard hasCRC else { return nil }
            let v = crcValue
            return Data([UInt8(v >> 24), UInt8(v >> 16 & 0xFF), UInt8(v >> 8 & 0xFF), UInt8(v & 0xFF)]).base64EncodedString()
        }
        set {
            let v = newValue.flatMap(Checksum.crc32c(base64:))
            crcValue = v ?? 0
            hasCRC = v != nil
        }
    }

    /// POSIX metadata of `gsutil -P` / `gcloud storage cp --preserve-posix` uploads
    /// (`goog-reserved-posix-mode/uid/gid`): permission bits and owner, nil when absent.
    public var posixMode: UInt16? {
        get { modeValue == .max ? nil : modeValue }
        set { modeValue = newValue.map { $0 & 0o777 } ?? .max }
    }
    public var posixUID: UInt32? {
        get { uidValue == .max ? nil : uidValue }
        set { uidValue = newValue ?? .max }
    }
    public var posixGID: UInt32? {
        get { gidValue == .max ? nil : gidValue }
        set { gidValue = newValue ?? .max }
    }

    /// A symbolic link as gcsfuse stores it (README, "Compatibility"): the target in the
    /// custom metadata (`gcsfuse_symlink_target`, legacy) or as the object's bytes
    /// (`goog-reserved-file-is-symlink: true`).
    public var symlink: SymlinkStyle? {
        get { SymlinkStyle(rawValue: symlinkValue) }
        set { symlinkValue = newValue?.rawValue ?? 0 }
    }

    public enum SymlinkStyle: UInt8, Sendable, Equatable {
        case targetInMetadata = 1
        case targetInContent = 2
    }

    public static let legacySymlinkKey = "gcsfuse_symlink_target"
    public static let standardSymlinkKey = "goog-reserved-file-is-symlink"

    public init(size: Int64, generation: Int64, modified: Timestamp, crc32c: String? = nil, posixMode: UInt16? = nil,
                posixUID: UInt32? = nil, posixGID: UInt32? = nil, symlink: SymlinkStyle? = nil) {
        self.size = size
        self.generation = generation
        mtimeSeconds = modified.seconds
        mtimeNanos = modified.nanoseconds
        crcValue = 0
        hasCRC = false
        uidValue = .max
        gidValue = .max
        modeValue = .max
        symlinkValue = 0
        self.crc32c = crc32c
        self.posixMode = posixMode
        self.posixUID = posixUID
        self.posixGID = posixGID
        self.symlink = symlink
    }

    /// A record with the crc32c as its value (a manifest index keeps it so).
    init(size: Int64, generation: Int64, modified: Timestamp, crc32cValue: UInt32?) {
        self.init(size: size, generation: generation, modified: modified)
        crcValue = crc32cValue ?? 0
        hasCRC = crc32cValue != nil
    }

    public init(_ meta: ObjectMetadata) {
        let custom = meta.custom
        // The mode may be written with its file-type bits (`100755`) or without (`755`).
        let mode = custom["goog-reserved-posix-mode"].flatMap { UInt32($0, radix: 8) }.map { UInt16($0 & 0o777) }
        var symlink: SymlinkStyle? = nil
        if let target = custom[Self.legacySymlinkKey], !target.isEmpty {
            symlink = .targetInMetadata
        } else if custom[Self.standardSymlinkKey] == "true" {
            symlink = .targetInContent
        }
        self.init(size: meta.size,
                  generation: meta.generation, modified: meta.modificationTime,
                  crc32c: meta.crc32c, posixMode: mode,
                  posixUID: custom["goog-reserved-posix-uid"].flatMap { UInt32($0) },
                  posixGID: custom["goog-reserved-posix-gid"].flatMap { UInt32($0) }, symlink: symlink)
        if symlink == .targetInMetadata { metadataTargetLength = UInt16(min(custom[Self.legacySymlinkKey]!.utf8.count, 0xFFFF)) }
    }

    /// What `stat` shows as the size of the symlink: its target's length.
    var symlinkSize: Int64 { symlink == .targetInMetadata ? Int64(metadataTargetLength) : size }

    /// The object resource a read needs (name, bucket, size, generation, crc32c): rebuilt at
    /// open from the record, so the read path never depends on what was kept for `stat`.
    func objectMetadata(name: String, bucket: String) -> ObjectMetadata {
        ObjectMetadata(name: name, bucket: bucket, size: size, generation: generation, updated: modified, crc32c: crc32c)
    }
}
