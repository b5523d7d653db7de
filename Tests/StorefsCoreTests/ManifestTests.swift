import Foundation
import Glibc
import Testing
import StorageClient
@testable import StorefsCore
import StorefsTestSupport

/// Manifest files on disk and what reading them gives.
struct ManifestFixture {
    let dir = temporaryDirectory()

    @discardableResult
    func write(_ name: String, _ bytes: [UInt8]) -> String {
        let path = dir + "/" + name
        #expect(FileManager.default.createFile(atPath: path, contents: Data(bytes)))
        return path
    }

    @discardableResult
    func write(_ name: String, _ text: String) -> String { write(name, Array(text.utf8)) }

    static func gzip(_ bytes: [UInt8]) throws -> [UInt8] {
        let encoder = try #require(GzipEncoder())
        var out: [UInt8] = []
        try bytes.withUnsafeBytes { b in try encoder.encode(b, finish: true) { out += $0 } }
        return out
    }

    /// Every row of a file: name and record.
    static func rows(_ path: String, bucket: String? = "b") throws(ManifestError) -> [(String, ManifestRecord)] {
        var out: [(String, ManifestRecord)] = []
        _ = try ManifestParser(bucket: bucket).read(path: path) { name, record in
            out.append((String(decoding: name, as: UTF8.self), record))
        }
        return out
    }

    /// The one-line error reading `path` gives (nil: none).
    static func problem(_ path: String, bucket: String? = "b") -> String? {
        do throws(ManifestError) {
            _ = try rows(path, bucket: bucket)
            return nil
        } catch {
            return error.message
        }
    }

    func open(_ path: String, prefix: String = "", refresh: ManifestNamespace.Refresh = .never, runLimit: Int? = nil,
              cache: String? = nil) throws -> ManifestNamespace.Opened {
        try ManifestNamespace.open(try ManifestSource(path: path), cacheDirectory: cache ?? dir + "/cache", bucket: "b",
                                   prefix: prefix, refresh: refresh, runLimit: runLimit)
    }
}

/// The entries of directory `path` of a manifest namespace, as readdir gives them.
func manifestListing(_ m: ManifestNamespace, _ path: String) throws -> [String] {
    let dir = try #require(try m.directory(path))
    return try dir.entries(from: 0, limit: .max).map(\.0)
}

func manifestKind(_ m: ManifestNamespace, _ parent: String, _ name: String) throws -> Node.Kind? {
    if case .found(let kind) = try m.lookup(parentPath: parent, name: name) { return kind }
    return nil
}

let inventoryHeader = "project,bucket,name,location,size,timeCreated,timeDeleted,updated,storageClass,etag,"
    + "retentionExpirationTime,crc32c,md5Hash,generation,metageneration,contentType,contentEncoding,timeStorageClassUpdated"

/// An inventory report row with the default columns (`gcloud storage insights inventory-reports create`).
func inventoryRow(_ name: String, size: Int, generation: Int64, bucket: String = "b", deleted: String = "",
                  crc: String = "AAAAAQ==") -> String {
    let quoted = name.contains(",") || name.contains("\"") ? "\"" + name.replacingOccurrences(of: "\"", with: "\"\"") + "\"" : name
    return "p,\(bucket),\(quoted),US,\(size),2024-01-02T03:04:05.000Z,\(deleted),2024-02-03T04:05:06.789Z,STANDARD,CJ+e,"
        + ",\(crc),1B2M2Y8AsgTpgAmY7PhCfg==,\(generation),1,text/plain,,2024-01-02T03:04:05.000Z"
}

@Suite struct ManifestParserTests {
    let f = ManifestFixture()

    @Test func anInventoryReportWithItsDefaultColumnsIsRead() throws {
        let path = f.write("report.csv", [inventoryHeader, inventoryRow("a/b.txt", size: 5, generation: 7),
                                          inventoryRow("x,y \"q\".bin", size: 0, generation: 9)].joined(separator: "\r\n") + "\r\n")
        let rows = try ManifestFixture.rows(path)
        #expect(rows.map(\.0) == ["a/b.txt", "x,y \"q\".bin"])
        #expect(rows[0].1 == ManifestRecord(size: 5, generation: 7, modified: Timestamp(seconds: 1_706_933_106, nanoseconds: 789_000_000),
                                             crc32c: 1))
    }

    @Test func unknownColumnsAndAByteOrderMarkAreIgnored() throws {
        let path = f.write("m.csv", [0xEF, 0xBB, 0xBF] + Array("extra,name,generation,size\nzz,f,3,4\n".utf8))
        let rows = try ManifestFixture.rows(path)
        #expect(rows.count == 1 && rows[0].0 == "f" && rows[0].1.size == 4 && rows[0].1.generation == 3)
        #expect(rows[0].1.modified == Timestamp(seconds: 0))
    }

    @Test(arguments: [
        ("name,size\nf,1\n", "no generation column"),
        ("size,generation\n1,2\n", "no name column"),
        ("name,generation\nf,2\n", "no size column"),
    ])
    func anAbsentRequiredColumnIsAnErrorNamingIt(text: String, expected: String) throws {
        let path = f.write("m.csv", text)
        let why = try #require(ManifestFixture.problem(path))
        #expect(why.contains(expected) && why.contains(path) && why.contains("line 1"), "\(why)")
    }

    @Test func aHugeLineIsAnErrorNamingFileAndLine() throws {
        let huge = String(repeating: "x", count: 100_000)
        let path = f.write("m.csv", "name,size,generation\nok,1,1\n\(huge),1,1\nlater,1,1\n")
        let why = try #require(ManifestFixture.problem(path))
        #expect(why.contains("line 3") && why.contains("longer than") && why.contains(path), "\(why)")
    }

    @Test func aNameLongerThanAnyObjectNameIsAnError() throws {
        let path = f.write("m.csv", "name,size,generation\n\(String(repeating: "n", count: 1025)),1,1\n")
        #expect(try #require(ManifestFixture.problem(path)).contains("line 2"))
    }

    @Test func badUTF8InANameIsAnErrorNamingTheLine() throws {
        let path = f.write("m.csv", Array("name,size,generation\nok,1,1\n".utf8) + [0x61, 0xFF, 0x62] + Array(",1,1\n".utf8))
        let why = try #require(ManifestFixture.problem(path))
        #expect(why.contains("line 3") && why.contains("UTF-8"), "\(why)")
        let overlong = f.write("o.csv", Array("name,size,generation\n".utf8) + [0xC0, 0xAF] + Array(",1,1\n".utf8))
        #expect(try #require(ManifestFixture.problem(overlong)).contains("UTF-8"))
        let surrogate = f.write("s.csv", Array("name,size,generation\n".utf8) + [0xED, 0xA0, 0x80] + Array(",1,1\n".utf8))
        #expect(try #require(ManifestFixture.problem(surrogate)).contains("UTF-8"))
    }

    @Test(arguments: [
        ("f,1\n", "2 fields, but the header has 3"),
        ("f,1,1,1\n", "4 fields"),
        ("\"f\"x,1,1\n", "not valid CSV"),
        ("f,-1,1\n", "size -1"),
        ("f,1,0\n", "generation 0"),
        ("f,1,\n", "no generation"),
        ("f,12345678901234567890,1\n", "size"),
    ])
    func aMalformedRowIsAnErrorNamingItsLine(row: String, expected: String) throws {
        let path = f.write("m.csv", "name,size,generation\nfine,1,1\n" + row + "after,1,1\n")
        let why = try #require(ManifestFixture.problem(path))
        #expect(why.contains("line 3") && why.contains(expected), "\(why)")
    }

    @Test(arguments: [
        ("updated", "yesterday", "not an RFC 3339 time"),
        ("crc32c", "AAAA", "not the base64 of 4 bytes"),
        ("crc32c", "AAAAA/==", "not the base64 of 4 bytes"),
    ])
    func malformedOptionalValuesAreErrorsToo(column: String, value: String, expected: String) throws {
        let path = f.write("m.csv", "name,size,generation,\(column)\nf,1,1,\(value)\n")
        #expect(try #require(ManifestFixture.problem(path)).contains(expected))
    }

    @Test func timesInTheFormsInventoriesUseAreRead() throws {
        let path = f.write("m.csv", "name,size,generation,updated\na,1,1,2024-02-03 04:05:06.5 UTC\nb,1,1,2024-02-03 04:05:06+00:00\n")
        let rows = try ManifestFixture.rows(path)
        #expect(rows.map(\.1.modified) == [Timestamp(seconds: 1_706_933_106, nanoseconds: 500_000_000), Timestamp(seconds: 1_706_933_106)])
    }

    @Test func aQuotedFieldMayHoldCommasQuotesAndLineEndings() throws {
        let path = f.write("m.csv", "name,size,generation\n\"a,\"\"b\"\"\nc\",1,1\nnext,2,2\n")
        let rows = try ManifestFixture.rows(path)
        #expect(rows.map(\.0) == ["a,\"b\"\nc", "next"])
        // The line numbers after it still count lines of the file.
        let bad = f.write("n.csv", "name,size,generation\n\"a\nb\",1,1\nbroken\n")
        #expect(try #require(ManifestFixture.problem(bad)).contains("line 4"))
        let open = f.write("o.csv", "name,size,generation\n\"never closed,1,1\n")
        #expect(try #require(ManifestFixture.problem(open)).contains("never closed"))
    }

    @Test func rowsOfAnotherBucketAreAnError() throws {
        let path = f.write("m.csv", [inventoryHeader, inventoryRow("a", size: 1, generation: 1, bucket: "other")].joined(separator: "\n"))
        let why = try #require(ManifestFixture.problem(path))
        #expect(why.contains("bucket other") && why.contains("line 2"), "\(why)")
    }

    @Test func rowsOfDeletedObjectsAreSkippedAndCounted() throws {
        let path = f.write("m.csv", [inventoryHeader, inventoryRow("gone", size: 1, generation: 1, deleted: "2024-03-01T00:00:00Z"),
                                     inventoryRow("here", size: 1, generation: 2)].joined(separator: "\n"))
        var names: [String] = []
        let stats = try ManifestParser(bucket: "b").read(path: path) { n, _ in names.append(String(decoding: n, as: UTF8.self)) }
        #expect(names == ["here"] && stats == ManifestParser.Stats(rows: 2, deleted: 1))
    }

    @Test func jsonLinesAreRead() throws {
        let path = f.write("m.jsonl", """
            {"name":"a/\\u00e9.bin","size":"12","generation":"34","updated":"2024-02-03T04:05:06Z","crc32c":"AAAAAg==","metadata":{"k":[1,2]}}

            {"name":"n","size":5,"generation":6,"timeDeleted":null}
            """)
        let rows = try ManifestFixture.rows(path)
        #expect(rows.map(\.0) == ["a/é.bin", "n"])
        #expect(rows[0].1 == ManifestRecord(size: 12, generation: 34, modified: Timestamp(seconds: 1_706_933_106), crc32c: 2))
        let bad = f.write("b.jsonl", "{\"name\":\"a\",\"size\":\"1\",\"generation\":\"1\"}\n{\"name\":\"b\",\"size\":\"1\"\n")
        let why = try #require(ManifestFixture.problem(bad))
        #expect(why.contains("line 2") && why.contains(bad), "\(why)")
        let missing = f.write("c.jsonl", "{\"name\":\"a\",\"size\":\"1\"}\n")
        #expect(try #require(ManifestFixture.problem(missing)).contains("no generation"))
    }

    @Test func gzippedManifestsAreReadAndATruncatedOneIsAnError() throws {
        var text = "name,size,generation\n"
        for i in 0..<20_000 { text += "dir\(i % 7)/file-\(i).bin,\(i),\(i + 1)\n" }
        let gz = try ManifestFixture.gzip(Array(text.utf8))
        let whole = f.write("m.csv.gz", gz)
        #expect(try ManifestFixture.rows(whole).count == 20_000)
        // Two members, as `cat a.gz b.gz` makes.
        let second = try ManifestFixture.gzip(Array("more,1,1\n".utf8))
        let both = f.write("two.csv.gz", gz + second)
        #expect(try ManifestFixture.rows(both).last?.0 == "more")
        for cut in [gz.count - 4, gz.count / 2, 11] {
            let path = f.write("cut\(cut).csv.gz", Array(gz.prefix(cut)))
            let why = try #require(ManifestFixture.problem(path), "a gzip cut at \(cut) of \(gz.count) bytes was read whole")
            #expect(why.contains(path) && (why.contains("cut short") || why.contains("damaged")), "\(why)")
        }
        var damaged = gz
        damaged[damaged.count / 2] ^= 0xFF
        #expect(ManifestFixture.problem(f.write("bad.csv.gz", damaged)) != nil)
    }

    @Test func anEmptyFileIsAnError() throws {
        #expect(try #require(ManifestFixture.problem(f.write("e.csv", ""))).contains("empty"))
    }

    @Test func aReportManifestNamesItsShardsAndTheirRowCountIsChecked() throws {
        f.write("r_0.csv", [inventoryHeader, inventoryRow("a", size: 1, generation: 1)].joined(separator: "\n") + "\n")
        f.write("r_1.csv", [inventoryHeader, inventoryRow("b", size: 2, generation: 2)].joined(separator: "\n") + "\n")
        let ok = f.write("r_manifest.json", """
            {"report_config":{"display_name":"x"},"records_processed":2,"snapshot_time":"2026-01-20T00:00:00Z",
             "shard_count":2,"report_shards_file_names":["dest/path/r_0.csv","dest/path/r_1.csv"]}
            """)
        let source = try ManifestSource(path: ok)
        #expect(source.files.map { ($0.path as NSString).lastPathComponent } == ["r_0.csv", "r_1.csv"])
        var names: [String] = []
        _ = try ManifestParser(bucket: "b").read(source) { n, _ in names.append(String(decoding: n, as: UTF8.self)) }
        #expect(names == ["a", "b"])

        let short = f.write("s_manifest.json", """
            {"records_processed":3,"shard_count":2,"report_shards_file_names":["r_0.csv","r_1.csv"]}
            """)
        do {
            _ = try ManifestParser(bucket: "b").read(try ManifestSource(path: short)) { _, _ in }
            Issue.record("a report whose shards hold fewer rows than it says was read")
        } catch {
            #expect(error.message.contains("holds 3 rows") && error.message.contains("hold 2"), "\(error.message)")
        }
        let missing = f.write("m_manifest.json", """
            {"records_processed":2,"shard_count":2,"report_shards_file_names":["r_0.csv","r_9.csv"]}
            """)
        #expect(throws: ManifestError.self) { try ManifestSource(path: missing) }
    }

    @Test func aDirectoryMeansEveryManifestFileInIt() throws {
        let dir = f.dir + "/shards"
        mkdir(dir, 0o755)
        f.write("shards/b.csv", "name,size,generation\nb,1,1\n")
        f.write("shards/a.csv.gz", try ManifestFixture.gzip(Array("name,size,generation\na,1,1\n".utf8)))
        f.write("shards/notes.txt", "not a manifest")
        let source = try ManifestSource(path: dir)
        #expect(source.files.map { ($0.path as NSString).lastPathComponent } == ["a.csv.gz", "b.csv"])
    }

    @Test func whatTheWriterWritesReadsBackTheSame() throws {
        var objects: [ObjectMetadata] = []
        for (i, name) in ["plain.bin", "with,comma \"and quotes\"", "ünï/cødé 日本", "dir/"].enumerated() {
            var m = ObjectMetadata(name: name, bucket: "b", size: Int64(i * 1000), generation: Int64(100 + i),
                                   updated: Timestamp(seconds: 1_700_000_000 + Int64(i), nanoseconds: Int32(i * 1000)),
                                   crc32c: i == 1 ? nil : "AAAAAw==")
            if i == 2 { m.custom["mtime"] = "2001-02-03T04:05:06.25Z" }
            objects.append(m)
        }
        for format in [ManifestWriter.Format.csv, .jsonl] {
            for gzip in [false, true] {
                let path = f.dir + "/w-\(format)-\(gzip)"
                let fd = Glibc.open(path, O_WRONLY | O_CREAT | O_TRUNC, 0o600)
                let writer = try ManifestWriter(fd: fd, format: format, gzip: gzip)
                for m in objects { try writer.write(m) }
                try writer.finish()
                close(fd)
                let rows = try ManifestFixture.rows(path)
                #expect(rows.map(\.0) == objects.map(\.name), "\(format) gzip=\(gzip)")
                #expect(rows.map(\.1) == objects.map {
                    ManifestRecord(size: $0.size, generation: $0.generation, modified: $0.modificationTime,
                                   crc32c: $0.crc32c.flatMap { Checksum.crc32c(base64: $0) })
                }, "\(format) gzip=\(gzip)")
            }
        }
    }

    /// The Firebase emulator's v0 metadata gives `crc32c` in decimal: a manifest written from
    /// it carries the base64 the parser reads (its mount refused the manifest before).
    @Test func aDecimalCRC32CIsWrittenAsBase64AndAnythingElseLeftOut() {
        #expect(ManifestWriter.base64CRC32C("1232738877") == "SXoaPQ==")
        #expect(ManifestWriter.base64CRC32C("AAAAAw==") == "AAAAAw==")
        #expect(ManifestWriter.base64CRC32C("4294967296") == nil)
        #expect(ManifestWriter.base64CRC32C("not a crc") == nil)
        #expect(Checksum.crc32c(base64: ManifestWriter.base64CRC32C("1232738877")!) == 1_232_738_877)
    }
}

@Suite struct ManifestIndexTests {
    let f = ManifestFixture()

    @Test func theTreeHasEveryDirectoryAndEachDirectorysNamesInByteOrder() throws {
        let path = f.write("m.csv", """
            name,size,generation,updated
            a/b/c.txt,5,1,2024-01-01T00:00:00Z
            a-b,3,2,2024-01-01T00:00:00Z
            a0,1,3,2024-01-01T00:00:00Z
            a/z,2,4,2024-01-01T00:00:00Z
            empty/,0,5,2024-01-01T00:00:00Z
            B,7,6,2024-01-01T00:00:00Z
            é,8,7,2024-01-01T00:00:00Z
            e\u{301},9,8,2024-01-01T00:00:00Z

            """)
        let opened = try f.open(path)
        let m = opened.namespace
        #expect(try manifestListing(m, "") == ["B", "a", "a-b", "a0", "empty", "e\u{301}", "é"])
        #expect(try manifestListing(m, "a") == ["b", "z"])
        #expect(try manifestListing(m, "a/b") == ["c.txt"])
        #expect(try manifestListing(m, "empty") == [])
        #expect(try manifestKind(m, "", "a") == .directory)
        guard case .file(let r)? = try manifestKind(m, "a/b", "c.txt") else { Issue.record("c.txt is not a file"); return }
        #expect(r.size == 5 && r.generation == 1 && r.modified == Timestamp(seconds: 1_704_067_200))
        // Canonically equivalent names are two names (bytes, not Unicode).
        guard case .file(let e1)? = try manifestKind(m, "", "é"), case .file(let e2)? = try manifestKind(m, "", "e\u{301}") else {
            Issue.record("é is missing"); return
        }
        #expect(e1.size == 8 && e2.size == 9)
        #expect(try m.lookup(parentPath: "", name: "nope").isAbsent)
        #expect(try m.lookup(parentPath: "a", name: "c.txt").isAbsent)
        #expect(opened.built?.files == 7 && opened.built?.directories == 4)
    }

    @Test func aFileNamedLikeADirectoryIsHiddenByIt() throws {
        let path = f.write("m.csv", "name,size,generation\na,1,1\na/b,2,2\nc,3,3\nc/,0,4\nd,5,5\n")
        let opened = try f.open(path)
        #expect(try manifestListing(opened.namespace, "") == ["a", "c", "d"])
        #expect(try manifestKind(opened.namespace, "", "a") == .directory)
        #expect(try manifestKind(opened.namespace, "", "c") == .directory)
        #expect(opened.built?.shadowed == 2 && opened.built?.shadowedNames == ["a", "c"])
    }

    @Test func ofANameGivenTwiceTheHighestGenerationIsKept() throws {
        let path = f.write("m.csv", "name,size,generation\nx,1,5\ny,1,1\nx,2,9\nx,3,7\n")
        let opened = try f.open(path)
        guard case .file(let r)? = try manifestKind(opened.namespace, "", "x") else { Issue.record("x is missing"); return }
        #expect(r.generation == 9 && r.size == 2)
        #expect(opened.built?.duplicates == 2 && opened.built?.files == 2)
    }

    @Test func namesThatCannotBePathComponentsAreHiddenAsListingsHideThem() throws {
        let long = String(repeating: "l", count: 256)
        let path = f.write("m.csv", """
            name,size,generation
            a//b,1,1
            x/../y,1,2
            ./z,1,3
            ok/\(long),1,4
            top/\(long)/deeper,1,5
            fine,1,6

            """)
        let opened = try f.open(path)
        let m = opened.namespace
        // Each directory a listing would show is there (its prefix exists), empty.
        #expect(try manifestListing(m, "") == ["a", "fine", "ok", "top", "x"])
        for d in ["a", "ok", "top", "x"] { #expect(try manifestListing(m, d) == [], "\(d)") }
        #expect(opened.built?.hidden == 5)
    }

    @Test func aPrefixMountSeesTheSubtreeOnly() throws {
        let path = f.write("m.csv", "name,size,generation\nsub/dir/f,1,1\nsub/g,2,2\nother,3,3\n")
        let m = try f.open(path, prefix: "sub").namespace
        #expect(try manifestListing(m, "") == ["dir", "g"])
        #expect(try manifestListing(m, "dir") == ["f"])
        #expect(m.firstFile() == "g")
        #expect(try f.open(path, prefix: "sub/dir").namespace.firstFile() == "f")
        let none = try f.open(path, prefix: "missing").namespace
        #expect(try manifestListing(none, "") == [] && none.firstFile() == nil)
    }

    @Test func sortingInRunsOnDiskGivesTheSameIndexAsInMemory() throws {
        var rng = SystemRandomNumberGenerator()
        var text = "name,size,generation\n"
        for i in 0..<3000 {
            let depth = Int.random(in: 0...3, using: &rng)
            let dirs = (0..<depth).map { _ in ["a", "a-b", "a0", "b", "é"][Int.random(in: 0..<5, using: &rng)] }
            text += (dirs + ["f\(i)"]).joined(separator: "/") + ",\(i),\(i + 1)\n"
            if i % 10 == 0 && depth > 0 { text += (dirs + [""]).joined(separator: "/") + ",0,\(i + 1)\n" }
            if i % 7 == 0 { text += (dirs + ["f\(i)"]).joined(separator: "/") + ",\(i),\(i + 5)\n" }
        }
        let path = f.write("m.csv", text)
        let inMemory = try f.open(path, cache: f.dir + "/c1")
        let runs = try f.open(path, runLimit: 97, cache: f.dir + "/c2")
        #expect(inMemory.built == runs.built)
        #expect(Array(inMemory.namespace.index.bytes) == Array(runs.namespace.index.bytes))
    }

    @Test func theIndexIsReusedAndBuiltAgainWhenTheManifestChanges() throws {
        let path = f.write("m.csv", "name,size,generation\na,1,1\n")
        #expect(try f.open(path).built != nil)
        #expect(try f.open(path).built == nil)
        // Same size, new contents and time: a new identity.
        f.write("m.csv", "name,size,generation\nb,1,1\n")
        var times = [timespec(tv_sec: 1_000_000, tv_nsec: 0), timespec(tv_sec: 1_000_000, tv_nsec: 0)]
        utimensat(AT_FDCWD, path, &times, 0)
        let again = try f.open(path)
        #expect(again.built != nil)
        #expect(try manifestListing(again.namespace, "") == ["b"])
    }

    /// The index of a small manifest, byte for byte: a change of the format must bump
    /// `ManifestIndexFormat.version` and this golden value.
    @Test func theIndexFormatIsPinned() throws {
        let path = f.write("m.csv", "name,size,generation,updated,crc32c\nd/f,5,7,2024-01-02T03:04:05.5Z,AAAAAQ==\ng,3,9,1970-01-01T00:00:01Z,\n")
        let cache = try CacheDirectory(directory: f.dir + "/golden", versionName: ManifestIndexFormat.versionName)
        _ = try ManifestIndexBuilder().build(try ManifestSource(path: path), parser: ManifestParser(bucket: nil),
                                             identity: [UInt8](repeating: 0xAB, count: 32), into: cache, as: "g.idx")
        let bytes = try #require(FileManager.default.contents(atPath: f.dir + "/golden/mf-v1/g.idx"))
        let hex = bytes.map { String(format: "%02x", $0) }.joined()
        #expect(hex == Self.golden, "\(hex)")
    }

    static let golden = "535446534d49580001000000280000000200000000000000030000000000000002000000000000008000000000000000"
        + "03000000000000008800000000000000a8000000000000002001000000000000abababababababababababababababab"
        + "abababababababababababababababab672e715e94af7379000000000000000064666700000000000000000000000000"
        + "020000000000000002000000000000000100000000000000000000000000010101000000000000000000000000000000"
        + "000000000000000000000000000000000200000000000100030000000000000009000000000000000100000000000000"
        + "0000000000000000010000000000010205000000000000000700000000000000257d9365000000000065cd1d01000000"

    @Test func aDamagedIndexIsBuiltAgain() throws {
        let path = f.write("m.csv", "name,size,generation\nd/f,1,1\ng,2,2\n")
        let first = try f.open(path)
        let index = first.indexPath
        let original = try #require(FileManager.default.contents(atPath: index))
        for damage in ["flip", "truncate", "empty"] {
            var bytes = [UInt8](original)
            switch damage {
            case "flip": bytes[bytes.count - 3] ^= 0x40
            case "truncate": bytes.removeLast(7)
            default: bytes = []
            }
            #expect(FileManager.default.createFile(atPath: index, contents: Data(bytes)))
            let again = try f.open(path)
            #expect(again.built != nil, "\(damage)")
            #expect(try manifestListing(again.namespace, "") == ["d", "g"], "\(damage)")
        }
    }

    /// An index whose checksums are right but whose offsets point outside it (as a bug or a
    /// crafted file could make): every use is bounds-checked, answers EIO, never crashes.
    @Test func offsetsOutOfBoundsAreDamageNotACrash() throws {
        let path = f.write("m.csv", "name,size,generation\nd/f,1,1\ng,2,2\n")
        let built = try f.open(path)
        let h = built.namespace.index.header
        var bytes = [UInt8](built.namespace.index.bytes)
        // The first child's name offset far past the blob, and directory 1's range past the table.
        let child = Int(h.childrenOffset)
        for i in 0..<6 { bytes[child + i] = 0xEE }
        let dir1 = Int(h.directoriesOffset) + 16
        for i in 0..<8 { bytes[dir1 + i] = 0x7F }
        var header = h
        header.contentCRC = bytes.withUnsafeBytes { Checksum.crc32c(UnsafeRawBufferPointer(rebasing: $0[128...])) }
        bytes.replaceSubrange(0..<128, with: header.encode())
        let crafted = f.write("crafted.idx", bytes)
        let fd = Glibc.open(crafted, O_RDONLY)
        defer { close(fd) }
        let damaged = Counter()
        let onDamage: @Sendable () -> Void = { damaged.add() }
        let mapped = ManifestIndex(fd: fd, identity: h.identity, onDamage: onDamage)
        let index = try #require(mapped)
        let m = ManifestNamespace(index: index, prefix: "", refresh: .never)
        #expect(throws: FilesystemError.self) { try manifestListing(m, "") }
        #expect(throws: FilesystemError.self) { try m.lookup(parentPath: "", name: "d") }
        #expect(throws: FilesystemError.self) { try m.lookup(parentPath: "d", name: "f") }
        #expect(throws: ManifestIndex.Damaged.self) { try index.children(of: 1) }
        #expect(throws: ManifestIndex.Damaged.self) { try index.children(of: 99) }
        #expect(throws: ManifestIndex.Damaged.self) { try index.child(-1) }
        #expect(damaged.value == 1)
    }
}

final class Counter: @unchecked Sendable {
    private let lock = NSLock()
    private var n = 0
    func add() { lock.lock(); n += 1; lock.unlock() }
    var value: Int { lock.lock(); defer { lock.unlock() }; return n }
}

extension ManifestNamespace.Answer {
    var isAbsent: Bool { if case .absent = self { return true } else { return false } }
}

/// A Filesystem mounted from a manifest of a MemoryStore bucket.
@Suite struct ManifestFilesystemTests {
    let store = MemoryStore(pageSize: 3)
    let f = ManifestFixture()

    /// A manifest of what the store holds now.
    func manifest(prefix: String = "", refresh: ManifestNamespace.Refresh = .never) throws -> ManifestNamespace {
        let path = f.dir + "/m.csv"
        let fd = Glibc.open(path, O_WRONLY | O_CREAT | O_TRUNC, 0o600)
        let writer = try ManifestWriter(fd: fd, format: .csv, gzip: false)
        try ManifestListing.run(store: store, reference: StorageReference(bucket: "b"), writer: writer) { _ in }
        try writer.finish()
        close(fd)
        return try f.open(path, prefix: prefix, refresh: refresh).namespace
    }

    func mount(_ m: ManifestNamespace, prefix: String = "") -> Filesystem {
        Filesystem(store: store, reference: StorageReference(bucket: "b", prefix: prefix),
                   config: .init(statTTL: 0, listTTL: 0, negativeTTL: 0), manifest: m)
    }

    func read(_ fs: Filesystem, _ handle: UInt64, count: Int) throws -> [UInt8] {
        var out = [UInt8](repeating: 0, count: count)
        let n = try out.withUnsafeMutableBytes { try fs.readWaiting(handle, at: 0, into: $0) }
        return Array(out.prefix(n))
    }

    func names(_ fs: Filesystem, _ inode: UInt64) throws -> [String] {
        let h = try fs.openListedDirectory(inode)
        defer { fs.release(h) }
        return try fs.readDirectory(h, from: 2).map(\.name)
    }

    @Test func lookupsReaddirAndReadsMakeNoListRequest() throws {
        store.put("a/b/c.txt", Array("hello".utf8))
        store.put("a/d.txt", Array("world!".utf8))
        store.put("top.bin", [1, 2, 3])
        let m = try manifest()
        let listed = store.requests.list
        let fs = mount(m)
        #expect(try names(fs, Filesystem.rootInode) == ["a", "top.bin"])
        let a = try fs.lookup(parent: Filesystem.rootInode, name: "a")
        #expect(try names(fs, a.inode) == ["b", "d.txt"])
        let d = try fs.lookup(parent: a.inode, name: "d.txt")
        #expect(d.kind == .file && d.size == 6)
        let h = try fs.open(d.inode, flags: O_RDONLY).handle
        #expect(try read(fs, h, count: 100) == Array("world!".utf8))
        // readdirplus answers from the index too.
        let dh = try fs.openListedDirectory(a.inode)
        #expect(try fs.lookupListed(dh, offsets: 2..<4).compactMap { $0?.size } == [4096, 6])
        fs.release(dh)
        #expect(store.requests.list == listed, "a manifest mount listed the bucket")
        #expect(store.requests.metadata == 0)
    }

    @Test func aNameNotInTheManifestDoesNotExistEvenInTheBucket() throws {
        store.put("old.txt", [1])
        let m = try manifest()
        store.put("new.txt", [2])
        let fs = mount(m)
        let listed = store.requests.list
        #expect(throws: FilesystemError.self) { try fs.lookup(parent: Filesystem.rootInode, name: "new.txt") }
        #expect(try names(fs, Filesystem.rootInode) == ["old.txt"])
        #expect(store.requests.list == listed && store.requests.metadata == 0)
    }

    @Test func aDeletedOrOverwrittenObjectReadsAsStale() throws {
        store.put("gone.txt", Array("before".utf8))
        store.put("changed.txt", Array("before".utf8))
        let m = try manifest()
        let listed = store.requests.list
        store.remove("gone.txt")
        store.put("changed.txt", Array("after!".utf8), generation: 2)
        let fs = mount(m)
        for name in ["gone.txt", "changed.txt"] {
            let attrs = try fs.lookup(parent: Filesystem.rootInode, name: name)
            let h = try fs.open(attrs.inode, flags: O_RDONLY).handle
            do {
                _ = try read(fs, h, count: 10)
                Issue.record("\(name) read although its generation is gone")
            } catch let error as FilesystemError {
                #expect(Errno.value(for: error.code) == ESTALE, "\(name): \(error)")
            }
            // Again: the same answer, never the new object's bytes.
            #expect(throws: FilesystemError.self) { try read(fs, h, count: 10) }
        }
        #expect(store.requests.list == listed)
    }

    @Test func withListRefreshAnOpenedDirectoryFollowsTheBucket() throws {
        store.put("d/old.txt", [1])
        store.put("d/kept.txt", [2])
        let m = try manifest(refresh: .list)
        store.remove("d/old.txt")
        store.put("d/new.txt", [3])
        let fs = mount(m)
        let listed = store.requests.list
        // Before the directory is opened, the manifest answers for names it has, with no request.
        let d = try fs.lookup(parent: Filesystem.rootInode, name: "d")
        _ = try fs.lookup(parent: d.inode, name: "old.txt")
        #expect(store.requests.list == listed)
        // Opened, it is listed: what the bucket holds now.
        #expect(try names(fs, d.inode) == ["kept.txt", "new.txt"])
        #expect(store.requests.list > listed)
    }
}
