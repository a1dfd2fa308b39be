import Foundation
import XCTest
@testable import LlamaANE

/// The tensor names the host builds are the exporter's: `TensorNames` and `CarriedState` against the
/// committed table both sides check (`tensor_names.json`; the exporter's llama_ane/model/names.py is
/// checked against it by tests/test_tensor_names.py, which also checks that the table holds every
/// role declared in TensorNames.swift).
final class TensorNamesTests: XCTestCase {
    private static let names: [String: String] = [
        "inputIds": TensorNames.inputIds, "position": TensorNames.position, "positions": TensorNames.positions,
        "prefixLength": TensorNames.prefixLength, "suffixPositions": TensorNames.suffixPositions,
        "depths": TensorNames.depths, "treeMask": TensorNames.treeMask, "slots": TensorNames.slots,
        "mask": TensorNames.mask, "slidingMask": TensorNames.slidingMask,
        "hiddenStates": TensorNames.hiddenStates, "hiddenStatesOut": TensorNames.hiddenStatesOut,
        "kCache": TensorNames.kCache, "vCache": TensorNames.vCache,
        "kCacheOut": TensorNames.kCacheOut, "vCacheOut": TensorNames.vCacheOut,
        "kRing": TensorNames.kRing, "vRing": TensorNames.vRing, "ringSlots": TensorNames.ringSlots,
        "convState": TensorNames.convState, "convNew": TensorNames.convNew, "windowTokens": TensorNames.windowTokens,
        "convBranches": TensorNames.convBranches, "deltaState": TensorNames.deltaState,
        "deltaNew": TensorNames.deltaNew, "deltaBranches": TensorNames.deltaBranches,
        "perLayerInputs": TensorNames.perLayerInputs, "perLayerInputsOut": TensorNames.perLayerInputsOut,
        "perLayerInput": TensorNames.perLayerInput, "sharedPrefix": TensorNames.sharedPrefix,
        "logitsPrefix": TensorNames.logitsPrefix, "updatedSuffix": TensorNames.updatedSuffix,
    ]
    private static let sets: [String: Set<String>] = [
        "hostMasks": TensorNames.hostMasks, "caches": TensorNames.caches, "rings": TensorNames.rings,
    ]

    private func table(_ key: String) throws -> [String: JSONValue] {
        let root = try JSONValue.parse(Data(contentsOf: Fixtures.url("tensor_names.json")))
        let pairs = try XCTUnwrap(root[key]?.objectValue, "tensor_names.json has no \(key)")
        return Dictionary(uniqueKeysWithValues: pairs)
    }

    private func strings(_ object: [String: JSONValue]) throws -> [String: String] {
        try object.mapValues { try XCTUnwrap($0.stringValue) }
    }

    func testEveryNameIsTheTables() throws {
        XCTAssertEqual(Self.names, try strings(try table("names")))
        let sets = try table("sets").mapValues { Set(try XCTUnwrap($0.arrayValue).compactMap(\.stringValue)) }
        XCTAssertEqual(Self.sets, sets)
    }

    func testMadeNamesAreTheTables() throws {
        let made = try table("made")
        let updated = try strings(Dictionary(uniqueKeysWithValues: try XCTUnwrap(made["updated"]?.objectValue)))
        let shared = try strings(Dictionary(uniqueKeysWithValues: try XCTUnwrap(made["shared"]?.objectValue)))
        let logits = try strings(Dictionary(uniqueKeysWithValues: try XCTUnwrap(made["logits"]?.objectValue)))
        XCTAssertFalse(updated.isEmpty || shared.isEmpty || logits.isEmpty)
        for (input, name) in updated { XCTAssertEqual(TensorNames.updated(input), name) }
        for (input, name) in shared { XCTAssertEqual(TensorNames.shared(input), name) }
        for (split, name) in logits { XCTAssertEqual(TensorNames.logits(try XCTUnwrap(Int(split))), name) }
    }

    /// Each carried state's names and moves, the moves by their `StateCarry.Operation` case names.
    func testCarriedStatesAreTheTables() throws {
        func caseName(_ operation: StateCarry.Operation) -> String {
            switch operation {
            case .afterWindow: return "afterWindow"
            case .afterBranchStep: return "afterBranchStep"
            case .copyToBranches: return "copyToBranches"
            case .replace: return "replace"
            case .copyToBranchRows: return "copyToBranchRows"
            }
        }
        let carried = try table("carried")
        XCTAssertEqual(Set(carried.keys), Set(CarriedState.allCases.map(\.rawValue)))
        for state in CarriedState.allCases {
            let row = try strings(Dictionary(uniqueKeysWithValues: try XCTUnwrap(carried[state.rawValue]?.objectValue)))
            XCTAssertEqual(row, ["state": state.stateName, "new": state.newName, "branches": state.branchesName,
                                 "afterWindow": caseName(state.afterWindow(realTokens: 1)),
                                 "afterBranchStep": caseName(state.afterBranchStep),
                                 "copyToBranches": caseName(state.copyToBranches)], state.rawValue)
        }
    }
}
